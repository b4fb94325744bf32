"""An asynchronous RL pipeline on Ray (the optional `rl` extra): rollout producers behind an engine
adapter, a trainer on the runtime, weights from the trainer to the producers, and admission control
that bounds staleness by eta without dropping samples.

    import ray
    from bumblebee.runtime.pipeline import CopyDigits, Objective, Pipeline, PipelineConfig, Sampling
    ray.init(num_cpus=2)
    cfg = PipelineConfig(steps=60, eta=2, sampling=Sampling(max_new_tokens=3), objective=Objective())
    with Pipeline(cfg, model_config, CopyDigits()) as p:
        log = p.run(log_path="run.jsonl")                 # one progress line per step

The modules without Ray (config, admission, samples, trainer, engine, tasks) import without it; the
actors, the weight channel and the driver need it.
"""
from bumblebee.runtime.pipeline.admission import Admission, Lease
from bumblebee.runtime.pipeline.config import Objective, PipelineConfig, PipelineTimeout, Sampling
from bumblebee.runtime.pipeline.samples import Completion, Group, grpo_advantages, informative, to_batch, version_spans
from bumblebee.runtime.pipeline.tasks import CopyDigits

__all__ = ["Admission", "Completion", "CopyDigits", "Group", "Lease", "Objective", "Pipeline", "PipelineConfig",
           "PipelineTimeout", "Sampling", "grpo_advantages", "informative", "to_batch", "version_spans"]


def __getattr__(name):  # Pipeline needs Ray: imported on first use
    if name == "Pipeline":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ImportError("the RL pipeline needs Ray: pip install -e '.[rl]'") from None
        from bumblebee.runtime.pipeline.run import Pipeline
        return Pipeline
    raise AttributeError(name)
