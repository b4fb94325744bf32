"""verl on a machine without accelerators, adapted through verl's own configuration (its platform
registry), never through the engine: verl 0.9.1 ships no CPU platform and falls back to "nvidia",
so its workers would allocate metrics and micro-batch counts on "cuda". A "cpu" platform registered
in `verl.plugin.platform.PlatformRegistry` and selected with `VERL_PLATFORM=cpu` (verl's own
override) makes `get_device_name()` "cpu", `get_torch_device()` a module with the memory queries
verl's workers make, and the communication backend gloo. Under Ray (verl's PPO trainer) verl
imports this module in every process through `VERL_USE_EXTERNAL_MODULES=tests.e2e.verl_cpu`; there
its workers' process group is plain gloo (`_gloo_process_group_ray`). Imported only where verl is
installed."""
from __future__ import annotations

import contextlib
import os
import sys
import types

import torch
import verl.utils.distributed as verl_distributed
from verl.plugin.platform import platform_manager
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry


def _zero(*args, **kwargs):
    return 0


# torch.cpu plus the CUDA memory queries verl's workers log (perf/max_memory_allocated_gb, ...)
DEVICE = types.SimpleNamespace(**{k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("_")})
for _name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved",
              "reset_peak_memory_stats", "empty_cache", "manual_seed", "manual_seed_all", "ipc_collect"):
    setattr(DEVICE, _name, _zero)
DEVICE.mem_get_info = lambda *a, **k: (0, 0)
DEVICE.get_device_name = lambda *a, **k: "CPU"  # verl's FLOPs table: unknown device, MFU 0
DEVICE.is_available = lambda: True


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"
    device_module = DEVICE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return False  # only chosen through VERL_PLATFORM=cpu, never detected

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict:
        return {"num_cpus": num_gpus}

    def ray_noset_envvars(self) -> list:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def rollout_env_vars(self) -> dict:
        return {}

    def get_collective_module(self):
        return None

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def cudart(self):
        return None


_init_process_group_ray = verl_distributed.initialize_global_process_group_ray


def _gloo_process_group_ray(timeout_second=None, backend=None):
    """verl's workers under Ray build their process group as "cpu:gloo,<device>:<backend>", which
    torch refuses when the device is "cpu" too (a duplicate device type): plain gloo there."""
    if backend is None and platform_manager.get_platform().device_name == "cpu":
        backend = "gloo"
    return _init_process_group_ray(timeout_second=timeout_second, backend=backend)


# imported by verl itself in Ray's processes (VERL_USE_EXTERNAL_MODULES), before its workers' modules
for _module in ("verl.utils.distributed", "verl.workers.engine_workers", "verl.checkpoint_engine.base"):
    if _module in sys.modules:
        sys.modules[_module].initialize_global_process_group_ray = _gloo_process_group_ray


def use_cpu_platform() -> None:
    """Select the CPU platform in this process (each spawned rank calls it before verl's workers)."""
    if torch.cuda.is_available():
        return
    os.environ["VERL_PLATFORM"] = "cpu"
    os.environ["VERL_ENGINE_DEVICE"] = "cpu"
    if platform_manager._current_platform is None or platform_manager._current_platform.device_name != "cpu":
        platform_manager._current_platform = None  # re-detected from VERL_PLATFORM on the next call
