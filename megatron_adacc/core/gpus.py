"""The GPUs ``adacc plan`` knows: what a roofline needs of each, from its vendor's datasheet (no torch here: the
command line lists them before anything heavy loads)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_adacc.core.errors import IntegrationError


@dataclass(frozen=True)
class GpuSpec:
    """What a roofline needs of a GPU, from its vendor's datasheet: peak dense arithmetic and memory bandwidth."""

    name: str
    memory_bytes: int
    """The GPU's memory, as its name says it (binary gigabytes: the HBM stacks are powers of two)."""
    flops_bf16: float | None
    """Dense bf16 tensor-core FLOP/s (without structured sparsity); None where the GPU has no bf16 arithmetic."""
    flops_fp16: float
    """Dense fp16 tensor-core FLOP/s."""
    flops_fp32: float
    """Non-tensor fp32 FLOP/s (PyTorch keeps TF32 off for matrix products by default)."""
    bandwidth: float
    """Memory bandwidth, bytes per second."""

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s of matrix products in ``dtype`` (``bfloat16``, ``float16`` or ``float32``)."""
        if dtype == "float32":
            return self.flops_fp32
        if dtype == "float16":
            return self.flops_fp16
        if self.flops_bf16 is None:
            raise IntegrationError(f"{self.name} has no bf16 arithmetic; plan with --fp16 instead of --bf16")
        return self.flops_bf16


#: The GPUs ``adacc plan --device`` knows (SXM parts).
GPUS: dict[str, GpuSpec] = {
    # Tesla V100 SXM2 32GB datasheet: 125 TFLOPS tensor (fp16), 15.7 TFLOPS fp32, 900 GB/s HBM2; no bf16.
    # https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf
    "v100-32gb": GpuSpec("V100-SXM2-32GB", 32 * 2**30, None, 125e12, 15.7e12, 900e9),
    # A100 80GB SXM datasheet: 312 TFLOPS bf16/fp16 tensor (624 with sparsity), 19.5 TFLOPS fp32, 2,039 GB/s HBM2e.
    # https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
    "a100-80gb": GpuSpec("A100-SXM4-80GB", 80 * 2**30, 312e12, 312e12, 19.5e12, 2039e9),
    # H100 SXM datasheet: 1,979 TFLOPS bf16/fp16 tensor with sparsity (989 dense), 67 TFLOPS fp32, 3.35 TB/s HBM3.
    # https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
    "h100-80gb": GpuSpec("H100-SXM5-80GB", 80 * 2**30, 989e12, 989e12, 67e12, 3.35e12),
}
