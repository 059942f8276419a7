"""vLLM's CUDA platform for the CPU replica of the GPU image: an H200's answers without an H200.

``tools/gpu_transfer/gpu_replica.sh`` installs this module into the replica as two vLLM plugins, found by their
entry points in every process vLLM starts there:
- a platform plugin (``vllm.platform_plugins``): it answers what vLLM asks before it touches a
  device (capability 9.0, the name, the memory) as an H200 would; everything else is vLLM's own CUDA
  platform;
- a general plugin (``vllm.general_plugins``): the worker's ``init_device``, the first call that
  needs the GPU, records what vLLM chose and stops the engine start, in the engine-core process too,
  where the check cannot reach.
Nothing in qerl imports it.
"""

from __future__ import annotations

import json
import os

from vllm.platforms.cuda import NonNvmlCudaPlatform
from vllm.platforms.interface import DeviceCapability

H200_BYTES = 143_771 << 20  # what nvidia-smi reports on the lent H200


class ReplicaH200(NonNvmlCudaPlatform):
    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
        return DeviceCapability(9, 0)

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "NVIDIA H200 (CPU replica)"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return H200_BYTES


def activate() -> str:
    """The plugin's entry point: the platform's qualified name."""
    return f"{__name__}.ReplicaH200"


REACHED = "qerl replica: reached the worker's init_device"


def _model_loader(cfg: object) -> str:
    """The loader class this worker's ``load_model`` would get (qerl's is registered by the import of
    the worker extension, which vLLM does before ``init_device``)."""
    try:
        from vllm.model_executor.model_loader import get_model_loader

        return type(get_model_loader(cfg.load_config)).__name__  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001 - reported, and the check names it
        return f"error: {exc}"


def stop_at_device() -> None:
    """General plugin (every vLLM process loads it): the worker's ``init_device``, the first call that
    needs the GPU, writes what vLLM chose to ``$QERL_REPLICA_REACHED`` and stops the start there."""
    from vllm.v1.worker import gpu_worker

    if getattr(gpu_worker.Worker.init_device, "qerl_replica", False):
        return

    def init_device(self: object) -> None:
        cfg = self.vllm_config  # type: ignore[attr-defined]
        info = {
            "model_runner": "V2" if getattr(self, "use_v2_model_runner", False) else "V1",
            "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
            "quantization": str(cfg.model_config.quantization),
            "dtype": str(cfg.model_config.dtype),
            "lora": cfg.lora_config is not None,
            "worker": type(self).__name__,
            "model_loader": _model_loader(cfg),
            # names vLLM's compile cache (torch_compile_cache/<hash>): an AQN engine's must differ
            "config_hash": cfg.compute_hash(),
        }
        out = os.environ.get("QERL_REPLICA_REACHED")
        if out:
            tmp = f"{out}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(info, f)
            os.replace(tmp, out)
        raise RuntimeError(f"{REACHED}: {info}")

    init_device.qerl_replica = True  # type: ignore[attr-defined]
    gpu_worker.Worker.init_device = init_device
