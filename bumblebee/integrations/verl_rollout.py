"""A transformers-`generate` rollout for verl 0.9.1 (`actor_rollout_ref.rollout.name=hf`): the
smallest rollout verl's PPO trainer can run without vLLM, SGLang or TensorRT-LLM, e.g. on a CPU
machine for debugging a recipe end to end. Slow (no batching across requests, no paged KV cache):
for checks, never for training runs.

verl's trainer generates through rollout *servers*: `LLMServerManager` builds one `RolloutReplica`
per rollout world (`RolloutReplicaRegistry`), the agent loop sends token ids to the replica's
server handle (`server.generate.remote(prompt_ids=..., sampling_params=...) -> TokenOutput`), and
the hybrid actor worker pushes new weights into its `BaseRollout` (`get_rollout_class(name)`) after
each update (`ActorRolloutRefWorker.update_weights`, backend "naive": the engine's
`get_per_tensor_param()` stream). Here:
- `HFServer`: a Ray actor holding a transformers causal LM (fp32) loaded from `model.path`;
  `generate` samples with the rollout's temperature / top-k / top-p up to `response_length` tokens
  or EOS and returns each token's log-prob (of logits / temperature, as vLLM reports them);
- `HFReplica`: the replica; its server is one named actor per replica (no GPU, no HTTP address);
- `HFRolloutAdapter`: the worker-side rollout; `update_weights` gathers the streamed tensors and
  loads them into the server with `load_state_dict(strict=True)` (a name or shape the trainer does
  not send is an error, never a silently stale weight).

Importing this module registers the name "hf" in both of verl's registries; select it with
`actor_rollout_ref.rollout.name=hf` and import it in every Ray process (verl's
`VERL_USE_EXTERNAL_MODULES=bumblebee.integrations.verl_rollout`)."""
from __future__ import annotations

from typing import Any, Generator, Optional

import ray
import torch
from verl.workers.rollout import base as rollout_base
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

NAME = "hf"


def _server_name(replica_rank: int) -> str:
    return f"bumblebee_hf_rollout_{replica_rank}"


class HFServer:
    """One transformers model answering verl's token-in/token-out `generate` (run as a Ray actor)."""

    def __init__(self, model_config, response_length: int, seed: int = 0):
        from transformers import AutoModelForCausalLM
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig
        if response_length < 1:
            raise ValueError(f"response_length must be >= 1, got {response_length}")
        cfg = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)  # as verl's vLLM server does
        self.model = AutoModelForCausalLM.from_pretrained(cfg.local_path, dtype=torch.float32,
                                                          trust_remote_code=cfg.trust_remote_code).eval()
        tok = cfg.tokenizer
        eos = tok.eos_token_id if tok.eos_token_id is not None else self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.response_length = response_length
        self.generator = torch.Generator().manual_seed(seed)  # this actor's own sampling stream
        self.global_steps = None

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str = "",
                 **kwargs) -> TokenOutput:
        params = dict(sampling_params)
        max_tokens = int(params.pop("max_tokens", params.pop("max_new_tokens", self.response_length)))
        temperature = float(params.get("temperature", 1.0))
        top_k, top_p = int(params.get("top_k", -1)), float(params.get("top_p", 1.0))
        ids = torch.tensor([prompt_ids])
        out = self.model(input_ids=ids, use_cache=True)
        tokens, logps = [], []
        for _ in range(min(max_tokens, self.response_length)):
            logits = out.logits[0, -1].float()
            if temperature > 0:
                scaled = logits / temperature
                logp = torch.log_softmax(scaled, -1)
                masked = scaled.clone()
                if top_k > 0:
                    masked[masked < torch.topk(masked, min(top_k, masked.numel())).values[-1]] = -float("inf")
                if top_p < 1.0:
                    probs, order = torch.softmax(masked, -1).sort(descending=True)
                    drop = probs.cumsum(-1) - probs > top_p
                    masked[order[drop]] = -float("inf")
                tok = int(torch.multinomial(torch.softmax(masked, -1), 1, generator=self.generator))
            else:
                logp = torch.log_softmax(logits, -1)
                tok = int(logits.argmax())
            tokens.append(tok)
            logps.append(float(logp[tok]))
            if tok in self.eos:
                break
            out = self.model(input_ids=torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
        return TokenOutput(token_ids=tokens, log_probs=logps, stop_reason="completed",
                           extra_fields={"global_steps": self.global_steps})

    def update_weights(self, state: dict[str, torch.Tensor], global_steps: Optional[int] = None) -> None:
        self.model.load_state_dict(state, strict=True)
        self.global_steps = global_steps

    # verl's replica life cycle: nothing to free on CPU, nothing in flight between calls
    def wake_up(self): pass
    def sleep(self): pass
    def clear_kv_cache(self): pass
    def release_kv_cache(self): pass
    def resume_kv_cache(self): pass
    def abort_all_requests(self, reject_request: bool = False): pass
    def resume_generation(self): pass
    def start_profile(self, **kwargs): pass
    def stop_profile(self): pass


class HFReplica(RolloutReplica):
    """verl's rollout replica of `HFServer`: tensor/data/pipeline parallel sizes must be 1."""

    async def launch_servers(self):
        if self.world_size != 1:
            raise ValueError(f"rollout name '{NAME}' runs one process a replica: tensor_model_parallel_size, "
                             f"data_parallel_size and pipeline_model_parallel_size must be 1 (world {self.world_size})")
        actor = ray.remote(HFServer).options(name=_server_name(self.replica_rank), num_cpus=0.01,
                                             max_concurrency=1, get_if_exists=True)
        server = actor.remote(self.model_config, self.config.response_length,
                              seed=self.config.seed + self.replica_rank)  # verl's rollout.seed (default 42)
        await server.wake_up.remote()  # the model is loaded
        self.servers = [server]
        self._server_handle = server
        self._server_address = _server_name(self.replica_rank)  # the load balancer's key; no HTTP

    def rollout_worker_use_gpu(self) -> bool:
        return False


class HFRolloutAdapter(BaseRollout):
    """The hybrid worker's rollout: weights the trainer streams go to this replica's `HFServer`."""

    def __init__(self, config, model_config, device_mesh, *args, **kwargs):
        super().__init__(config, model_config, device_mesh)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.replica_rank = rank  # one process a replica (HFReplica refuses anything else)

    async def resume(self, tags: list[str]):
        pass

    async def release(self):
        pass

    async def update_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                             wire_format: str = "named_tensors", global_steps: Optional[int] = None, **kwargs):
        if wire_format != "named_tensors":
            raise ValueError(f"rollout '{NAME}' takes wire_format='named_tensors', got {wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise ValueError(f"rollout '{NAME}' takes full weights, not a LoRA adapter (peft_config)")
        state = {name: t.detach().to("cpu", copy=True) for name, t in weights}
        server = ray.get_actor(_server_name(self.replica_rank))
        await server.update_weights.remote(state, global_steps=global_steps)


def _load_replica():
    return HFReplica


RolloutReplicaRegistry.register(NAME, _load_replica)
# verl's worker-side table has no register function: its entries are "module.Class" names
rollout_base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.HFRolloutAdapter"
__all__ = ["HFServer", "HFReplica", "HFRolloutAdapter", "NAME"]
