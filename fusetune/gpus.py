"""Catalogue of supported NVIDIA GPUs, name resolution and visible-device discovery.

Only the standard library is imported at module level; ``torch`` and ``triton`` are
imported lazily inside the functions that talk to the hardware.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "CATALOGUE",
    "INTERPRETER",
    "GpuNotFoundError",
    "GpuSpec",
    "UnknownGpuError",
    "VisibleGpu",
    "current_gpu",
    "format_catalogue",
    "match_device_name",
    "resolve",
    "select_device",
    "select_devices",
    "spec_from_device",
    "visible_gpus",
]

_KIB = 1024
_MIB = 1024 * _KIB
# Static shared memory limit without opt-in; used when the opt-in value cannot be read.
_DEFAULT_SMEM_PER_BLOCK = 48 * _KIB


@dataclass(frozen=True)
class GpuSpec:
    """Hardware limits and datasheet performance of one GPU model."""

    name: str
    display: str
    aliases: tuple[str, ...]
    device_names: tuple[str, ...]
    compute_capability: tuple[int, int]
    sms: int
    smem_per_block: int
    smem_per_sm: int
    regs_per_block: int
    regs_per_thread: int
    max_threads_per_block: int
    memory_gb: float | None
    bandwidth_gbs: float | None
    peak_fp16_tflops: float | None
    peak_bf16_tflops: float | None
    known: bool = True
    # FP8 (e4m3/e5m2) tensor cores, compute capability 8.9+ (Ada, Hopper): where the matmul
    # kernels can multiply FP8 weights by FP8-quantized activations (FP8 activations, the
    # caller's mode). Elsewhere FP8 weights are upcast in registers and the e4m3 type is
    # decoded from its bytes.
    fp8_tensor_cores: bool = False
    # Dense FP8 tensor-core rate with float32 accumulation (the kernels' tl.dot), datasheet.
    peak_fp8_tflops: float | None = None
    # L2 cache in bytes (None: unknown).
    l2_bytes: int | None = None

    def peak_tflops(self, dtype: str, activations: str = "") -> float | None:
        """The datasheet rate that bounds a point's products from below: FP8 where its
        activations are FP8 (Point.activations; they multiply on the FP8 tensor cores), else
        the activations' 16-bit rate (weight-only FP8 upcasts its weights to it; float32
        activations included: a lower bound)."""
        if activations == "fp8" and self.fp8_tensor_cores and self.peak_fp8_tflops:
            return self.peak_fp8_tflops
        return self.peak_bf16_tflops if dtype == "bfloat16" else self.peak_fp16_tflops

    @property
    def tma(self) -> bool:
        """Whether kernels can read tiles through TMA descriptors (the tensor memory
        accelerator: compute capability 9.0+; the CPU interpreter emulates it)."""
        return self.compute_capability >= (9, 0) or self.name == "interpreter"

    @property
    def pdl(self) -> bool:
        """Whether a launch can be a programmatic dependent of the one before it (griddepcontrol:
        compute capability 9.0+; under the CPU interpreter the launches run one after the
        other, which is what such a launch waits for anyway)."""
        return self.compute_capability >= (9, 0) or self.name == "interpreter"


@dataclass(frozen=True)
class VisibleGpu:
    """A CUDA device visible to this process and its spec."""

    index: int
    torch_name: str
    spec: GpuSpec


class UnknownGpuError(ValueError):
    """Raised when a GPU name cannot be resolved."""


class GpuNotFoundError(RuntimeError):
    """Raised when the requested GPU is not among the visible CUDA devices."""


# Shared-memory sizes (bytes) from the CUDA C++ Programming Guide, "Technical
# Specifications per Compute Capability" (opt-in max per block / per SM; 1 KB per block is
# reserved for the system).
_SMEM_SM86_BLOCK, _SMEM_SM86_SM = 99 * _KIB, 100 * _KIB  # sm_86, sm_89, sm_120
_SMEM_SM80_BLOCK, _SMEM_SM80_SM = 163 * _KIB, 164 * _KIB  # sm_80
_SMEM_SM90_BLOCK, _SMEM_SM90_SM = 227 * _KIB, 228 * _KIB  # sm_90, sm_100

_COMMON = {"regs_per_block": 65536, "regs_per_thread": 255, "max_threads_per_block": 1024}

# Peak numbers are dense tensor-core FP16/BF16 with FP32 accumulate (no sparsity),
# from the NVIDIA architecture whitepapers / product datasheets (which quote the sparse rate,
# twice the dense one). GeForce cards accumulate FP16/BF16 and FP8 products in FP32 at half
# their FP16-accumulate rate. L2 sizes: the whitepapers and tuning guides.
CATALOGUE: tuple[GpuSpec, ...] = (
    GpuSpec(
        name="rtx-3090",
        display="NVIDIA GeForce RTX 3090",
        aliases=("3090", "rtx3090", "geforce-rtx-3090"),
        device_names=("NVIDIA GeForce RTX 3090",),
        compute_capability=(8, 6),
        sms=82,
        smem_per_block=_SMEM_SM86_BLOCK,
        smem_per_sm=_SMEM_SM86_SM,
        memory_gb=24.0,
        bandwidth_gbs=936.0,
        peak_fp16_tflops=71.0,
        peak_bf16_tflops=71.0,
        l2_bytes=6 * _MIB,
        **_COMMON,
    ),
    GpuSpec(
        name="rtx-4090",
        display="NVIDIA GeForce RTX 4090",
        aliases=("4090", "rtx4090", "geforce-rtx-4090"),
        device_names=("NVIDIA GeForce RTX 4090",),
        compute_capability=(8, 9),
        sms=128,
        smem_per_block=_SMEM_SM86_BLOCK,
        smem_per_sm=_SMEM_SM86_SM,
        memory_gb=24.0,
        bandwidth_gbs=1008.0,
        peak_fp16_tflops=165.2,
        peak_bf16_tflops=165.2,
        fp8_tensor_cores=True,
        peak_fp8_tflops=330.3,
        l2_bytes=72 * _MIB,
        **_COMMON,
    ),
    GpuSpec(
        name="a100-40gb",
        display="NVIDIA A100 40GB",
        aliases=("a100-40g", "a100-sxm4-40gb", "a100-pcie-40gb"),
        device_names=("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"),
        compute_capability=(8, 0),
        sms=108,
        smem_per_block=_SMEM_SM80_BLOCK,
        smem_per_sm=_SMEM_SM80_SM,
        memory_gb=40.0,
        bandwidth_gbs=1555.0,
        peak_fp16_tflops=312.0,
        peak_bf16_tflops=312.0,
        l2_bytes=40 * _MIB,
        **_COMMON,
    ),
    GpuSpec(
        name="a100-80gb",
        display="NVIDIA A100 80GB",
        aliases=("a100", "a100-80g", "a100-sxm4-80gb", "a100-pcie-80gb"),
        device_names=("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"),
        compute_capability=(8, 0),
        sms=108,
        smem_per_block=_SMEM_SM80_BLOCK,
        smem_per_sm=_SMEM_SM80_SM,
        memory_gb=80.0,
        bandwidth_gbs=2039.0,  # SXM4; the PCIe card is rated 1935 GB/s
        peak_fp16_tflops=312.0,
        peak_bf16_tflops=312.0,
        l2_bytes=40 * _MIB,
        **_COMMON,
    ),
    GpuSpec(
        name="l4",
        display="NVIDIA L4",
        aliases=("nvidia-l4",),
        device_names=("NVIDIA L4",),
        compute_capability=(8, 9),
        sms=58,
        smem_per_block=_SMEM_SM86_BLOCK,
        smem_per_sm=_SMEM_SM86_SM,
        memory_gb=24.0,
        bandwidth_gbs=300.0,
        peak_fp16_tflops=121.0,
        peak_bf16_tflops=121.0,
        fp8_tensor_cores=True,
        peak_fp8_tflops=242.5,
        l2_bytes=48 * _MIB,
        **_COMMON,
    ),
    GpuSpec(
        name="h100-sxm",
        display="NVIDIA H100 SXM5 80GB",
        aliases=("h100", "h100-sxm5", "h100-80gb-hbm3"),
        device_names=("NVIDIA H100 80GB HBM3",),
        compute_capability=(9, 0),
        sms=132,
        smem_per_block=_SMEM_SM90_BLOCK,
        smem_per_sm=_SMEM_SM90_SM,
        memory_gb=80.0,
        bandwidth_gbs=3350.0,
        peak_fp16_tflops=989.0,
        peak_bf16_tflops=989.0,
        fp8_tensor_cores=True,
        peak_fp8_tflops=1979.0,
        l2_bytes=50 * _MIB,
        **_COMMON,
    ),
    GpuSpec(
        name="h100-pcie",
        display="NVIDIA H100 PCIe 80GB",
        aliases=("h100-pcie-80gb",),
        device_names=("NVIDIA H100 PCIe",),
        compute_capability=(9, 0),
        sms=114,
        smem_per_block=_SMEM_SM90_BLOCK,
        smem_per_sm=_SMEM_SM90_SM,
        memory_gb=80.0,
        bandwidth_gbs=2000.0,
        peak_fp16_tflops=756.0,
        peak_bf16_tflops=756.0,
        fp8_tensor_cores=True,
        peak_fp8_tflops=1513.0,
        l2_bytes=50 * _MIB,
        **_COMMON,
    ),
    GpuSpec(
        name="h200",
        display="NVIDIA H200 SXM 141GB",
        aliases=("h200-sxm", "h200-141gb"),
        device_names=("NVIDIA H200",),
        compute_capability=(9, 0),
        sms=132,
        smem_per_block=_SMEM_SM90_BLOCK,
        smem_per_sm=_SMEM_SM90_SM,
        memory_gb=141.0,
        bandwidth_gbs=4800.0,
        peak_fp16_tflops=989.0,
        peak_bf16_tflops=989.0,
        fp8_tensor_cores=True,
        peak_fp8_tflops=1979.0,
        l2_bytes=60 * _MIB,  # as the device reports it (the H100's is 50 MB)
        **_COMMON,
    ),
    GpuSpec(
        name="l40s",
        display="NVIDIA L40S",
        aliases=("nvidia-l40s",),
        device_names=("NVIDIA L40S",),
        compute_capability=(8, 9),
        sms=142,
        smem_per_block=_SMEM_SM86_BLOCK,
        smem_per_sm=_SMEM_SM86_SM,
        memory_gb=48.0,
        bandwidth_gbs=864.0,
        peak_fp16_tflops=362.05,
        peak_bf16_tflops=362.05,
        fp8_tensor_cores=True,
        peak_fp8_tflops=733.0,
        l2_bytes=96 * _MIB,  # not on the datasheet: AD102's L2 (Ada whitepaper)
        **_COMMON,
    ),
    GpuSpec(
        name="a10g",
        display="NVIDIA A10G",
        aliases=("nvidia-a10g",),
        device_names=("NVIDIA A10G",),
        compute_capability=(8, 6),
        # AWS's variant of the A10 (GA102, 80 SMs), without an NVIDIA datasheet: memory and
        # bandwidth as AWS documents its G5 instances; NVIDIA publishes no tensor-core rate for
        # it (the A10's does not apply: another SM count and clock), so none is assumed.
        sms=80,
        smem_per_block=_SMEM_SM86_BLOCK,
        smem_per_sm=_SMEM_SM86_SM,
        memory_gb=24.0,
        bandwidth_gbs=600.0,
        peak_fp16_tflops=None,
        peak_bf16_tflops=None,
        l2_bytes=6 * _MIB,  # GA102's L2 (GA102 whitepaper)
        **_COMMON,
    ),
    GpuSpec(
        name="rtx-6000-ada",
        display="NVIDIA RTX 6000 Ada Generation",
        aliases=("6000-ada", "rtx-6000-ada-generation"),
        device_names=("NVIDIA RTX 6000 Ada Generation",),
        compute_capability=(8, 9),
        sms=142,
        smem_per_block=_SMEM_SM86_BLOCK,
        smem_per_sm=_SMEM_SM86_SM,
        memory_gb=48.0,
        bandwidth_gbs=960.0,
        # Ada whitepaper: 364.2 FP16/BF16 and 728.5 FP8 dense (the datasheet's 1457 TFLOPS is
        # FP8 with sparsity); a professional card, FP32 accumulation at the full rate.
        peak_fp16_tflops=364.2,
        peak_bf16_tflops=364.2,
        fp8_tensor_cores=True,
        peak_fp8_tflops=728.5,
        l2_bytes=96 * _MIB,
        **_COMMON,
    ),
    GpuSpec(
        name="h100-nvl",
        display="NVIDIA H100 NVL 94GB",
        aliases=("h100-nvl-94gb",),
        device_names=("NVIDIA H100 NVL",),
        compute_capability=(9, 0),
        sms=132,
        smem_per_block=_SMEM_SM90_BLOCK,
        smem_per_sm=_SMEM_SM90_SM,
        memory_gb=94.0,
        bandwidth_gbs=3900.0,
        # Per card, the datasheet's 1671 (FP16/BF16) and 3341 (FP8) TFLOPS with sparsity, halved
        # (early material quoted the rates of a pair of cards).
        peak_fp16_tflops=835.5,
        peak_bf16_tflops=835.5,
        fp8_tensor_cores=True,
        peak_fp8_tflops=1670.5,
        l2_bytes=None,  # not published
        **_COMMON,
    ),
    GpuSpec(
        name="h800",
        display="NVIDIA H800 SXM5 80GB",
        aliases=("h800-sxm", "h800-sxm5", "h800-80gb"),
        device_names=("NVIDIA H800",),
        compute_capability=(9, 0),
        # The H100 SXM5 with fewer NVLink links and a lower FP64 rate: its SMs, memory and
        # tensor-core rates.
        sms=132,
        smem_per_block=_SMEM_SM90_BLOCK,
        smem_per_sm=_SMEM_SM90_SM,
        memory_gb=80.0,
        bandwidth_gbs=3350.0,
        peak_fp16_tflops=989.0,
        peak_bf16_tflops=989.0,
        fp8_tensor_cores=True,
        peak_fp8_tflops=1979.0,
        l2_bytes=50 * _MIB,
        **_COMMON,
    ),
    GpuSpec(
        name="h20",
        display="NVIDIA H20 96GB",
        aliases=("h20-96gb", "nvidia-h20"),
        device_names=("NVIDIA H20",),
        compute_capability=(9, 0),
        # No public NVIDIA datasheet: memory, bandwidth and the dense rates (148 FP16/BF16, 296
        # FP8) are those NVIDIA's partners publish; the SM count and L2 are not published
        # (78 SMs as the device reports them, 60 MB as its vendors list it).
        sms=78,
        smem_per_block=_SMEM_SM90_BLOCK,
        smem_per_sm=_SMEM_SM90_SM,
        memory_gb=96.0,
        bandwidth_gbs=4000.0,
        peak_fp16_tflops=148.0,
        peak_bf16_tflops=148.0,
        fp8_tensor_cores=True,
        peak_fp8_tflops=296.0,
        l2_bytes=60 * _MIB,
        **_COMMON,
    ),
    GpuSpec(
        name="gh200",
        display="NVIDIA GH200 Grace Hopper (96GB HBM3)",
        aliases=("gh200-96gb", "gh200-480gb", "grace-hopper"),
        device_names=("NVIDIA GH200 480GB",),
        compute_capability=(9, 0),
        # The superchip's Hopper GPU (480GB names the Grace CPU's LPDDR5X). The datasheet gives
        # memory, bandwidth and rates, not the SM count (132, as the device reports it) nor the
        # L2 (not published).
        sms=132,
        smem_per_block=_SMEM_SM90_BLOCK,
        smem_per_sm=_SMEM_SM90_SM,
        memory_gb=96.0,
        bandwidth_gbs=4000.0,
        peak_fp16_tflops=989.0,
        peak_bf16_tflops=989.0,
        fp8_tensor_cores=True,
        peak_fp8_tflops=1979.0,
        l2_bytes=None,
        **_COMMON,
    ),
    GpuSpec(
        name="gh200-144gb",
        display="NVIDIA GH200 Grace Hopper (144GB HBM3e)",
        aliases=("gh200-hbm3e",),
        device_names=("NVIDIA GH200 144G HBM3e",),
        compute_capability=(9, 0),
        # The GH200 with HBM3e memory: as the gh200 entry but for memory and bandwidth.
        sms=132,
        smem_per_block=_SMEM_SM90_BLOCK,
        smem_per_sm=_SMEM_SM90_SM,
        memory_gb=144.0,
        bandwidth_gbs=4900.0,
        peak_fp16_tflops=989.0,
        peak_bf16_tflops=989.0,
        fp8_tensor_cores=True,
        peak_fp8_tflops=1979.0,
        l2_bytes=None,
        **_COMMON,
    ),
    GpuSpec(
        name="b200",
        display="NVIDIA B200 180GB",
        aliases=("b200-180gb", "hgx-b200"),
        device_names=("NVIDIA B200",),
        compute_capability=(10, 0),
        # HGX B200 datasheet (per GPU): 180 GB at 7.7 TB/s, 2.25 PFLOPS FP16/BF16 and 4.5 FP8
        # dense. The SM count is not published (148, as the device reports it); the L2 is the
        # Blackwell tuning guide's. Shared memory: compute capability 10.0, as 9.0.
        sms=148,
        smem_per_block=_SMEM_SM90_BLOCK,
        smem_per_sm=_SMEM_SM90_SM,
        memory_gb=180.0,
        bandwidth_gbs=7700.0,
        peak_fp16_tflops=2250.0,
        peak_bf16_tflops=2250.0,
        fp8_tensor_cores=True,
        peak_fp8_tflops=4500.0,
        l2_bytes=126 * _MIB,
        **_COMMON,
    ),
    GpuSpec(
        name="rtx-5090",
        display="NVIDIA GeForce RTX 5090",
        aliases=("5090", "rtx5090", "geforce-rtx-5090"),
        device_names=("NVIDIA GeForce RTX 5090",),
        compute_capability=(12, 0),
        sms=170,
        # Compute capability 12.0: 99 KB per block of a 100 KB carveout (as sm_86 and sm_89).
        smem_per_block=_SMEM_SM86_BLOCK,
        smem_per_sm=_SMEM_SM86_SM,
        memory_gb=32.0,
        bandwidth_gbs=1792.0,
        # RTX Blackwell whitepaper, FP32 accumulation (half the FP16-accumulate 419 and 838).
        peak_fp16_tflops=209.5,
        peak_bf16_tflops=209.5,
        fp8_tensor_cores=True,
        peak_fp8_tflops=419.0,
        l2_bytes=96 * _MIB,
        **_COMMON,
    ),
)

INTERPRETER = GpuSpec(
    name="interpreter",
    display="Triton CPU interpreter",
    aliases=("cpu",),
    device_names=(),
    compute_capability=(0, 0),
    sms=1,
    smem_per_block=_SMEM_SM90_BLOCK,
    smem_per_sm=_SMEM_SM90_SM,
    memory_gb=None,
    bandwidth_gbs=None,
    peak_fp16_tflops=None,
    peak_bf16_tflops=None,
    fp8_tensor_cores=True,  # it emulates every type, FP8 products included
    **_COMMON,
)

_BY_NAME: dict[str, GpuSpec] = {spec.name: spec for spec in CATALOGUE}


def _key(text: str) -> str:
    """Lookup key: lowercase with spaces, dashes, underscores (and dots) removed."""
    return re.sub(r"[\s_\-.]+", "", text.strip().lower())


def _build_index() -> dict[str, GpuSpec]:
    index: dict[str, GpuSpec] = {}
    for spec in (*CATALOGUE, INTERPRETER):
        for label in (spec.name, *spec.aliases, *spec.device_names):
            key = _key(label)
            other = index.setdefault(key, spec)
            if other is not spec:  # pragma: no cover - catalogue consistency guard
                raise AssertionError(f"{label!r} maps to both {other.name} and {spec.name}")
    return index


_INDEX: dict[str, GpuSpec] = _build_index()


def _valid_names() -> str:
    parts = []
    for spec in (*CATALOGUE, INTERPRETER):
        aliases = f" ({', '.join(spec.aliases)})" if spec.aliases else ""
        parts.append(f"{spec.name}{aliases}")
    return "; ".join(parts)


def resolve(name: str) -> GpuSpec:
    """Resolve a canonical name, alias or torch device name to its spec."""
    spec = _INDEX.get(_key(name))
    if spec is None and name.strip():
        spec = match_device_name(name)
    if spec is None:
        raise UnknownGpuError(f"unknown GPU {name!r}; valid names (aliases): {_valid_names()}")
    return spec


def _tokens(text: str) -> list[str]:
    return [t for t in re.split(r"[^a-z0-9]+", text.lower()) if t]


# Tokens that mark a different product sharing a model number (e.g. "RTX 3090 Ti",
# "RTX 4090 D", "RTX 4090 Laptop GPU").
_VARIANT_TOKENS = frozenset({"ti", "super", "d", "laptop", "mobile", "maxq", "max", "q"})


def _fallback(tokens: list[str]) -> GpuSpec | None:
    toks = set(tokens)
    if "gh200" in toks:  # "NVIDIA GH200 480GB", "NVIDIA GH200 144G HBM3e"
        hbm3e = "hbm3e" in toks or any(t.startswith("144g") for t in toks)
        return _BY_NAME["gh200-144gb" if hbm3e else "gh200"]
    if "h200" in toks:  # "NVIDIA H200", "NVIDIA H200 NVL"
        return _BY_NAME["h200"]
    if "h100" in toks:  # "NVIDIA H100", "NVIDIA H100 80GB HBM3", "NVIDIA H100 NVL"
        if "nvl" in toks:
            return _BY_NAME["h100-nvl"]
        return _BY_NAME["h100-pcie" if toks & {"pcie", "pci"} else "h100-sxm"]
    if "h800" in toks:  # the SXM5 module; the PCIe card has other limits
        return None if toks & {"pcie", "pci"} else _BY_NAME["h800"]
    if "b200" in toks:
        return _BY_NAME["b200"]
    if "a100" in toks or any(t.startswith("a100") for t in toks):
        return _BY_NAME["a100-40gb" if any("40gb" in t for t in toks) else "a100-80gb"]
    if "l4" in toks:
        return _BY_NAME["l4"]
    if "l40s" in toks:
        return _BY_NAME["l40s"]
    if "a10g" in toks:
        return _BY_NAME["a10g"]
    if {"6000", "ada"} <= toks:  # not the Turing "Quadro RTX 6000" nor the Ampere "RTX A6000"
        return _BY_NAME["rtx-6000-ada"]
    if toks & _VARIANT_TOKENS:
        return None
    for number in ("3090", "4090", "5090"):
        if number in toks or f"rtx{number}" in toks:
            return _BY_NAME[f"rtx-{number}"]
    return None


def match_device_name(torch_name: str) -> GpuSpec | None:
    """Map a ``torch.cuda.get_device_name()`` string to a catalogue spec, or None."""
    wanted = torch_name.strip().lower()
    for spec in CATALOGUE:
        if any(wanted == dev.lower() for dev in spec.device_names):
            return spec
    return _fallback(_tokens(torch_name))


def _slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _triton_max_shared_mem(index: int) -> int | None:
    try:
        import triton

        props = triton.runtime.driver.active.utils.get_device_properties(index)
        return int(props["max_shared_mem"])
    except Exception:  # triton missing, no driver, or an unexpected layout
        return None


def spec_from_device(index: int) -> GpuSpec:
    """Build a spec (``known=False``) from the properties torch reports for device ``index``."""
    import torch

    props = torch.cuda.get_device_properties(index)
    torch_name = str(props.name)
    smem_block = getattr(props, "shared_memory_per_block_optin", None)
    if not smem_block:
        smem_block = _triton_max_shared_mem(index) or _DEFAULT_SMEM_PER_BLOCK
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", None) or smem_block
    regs = getattr(props, "regs_per_multiprocessor", None) or 65536
    l2 = getattr(props, "L2_cache_size", None)
    return GpuSpec(
        name=_slugify(torch_name) or f"cuda-{index}",
        display=torch_name,
        aliases=(),
        device_names=(torch_name,),
        compute_capability=(int(props.major), int(props.minor)),
        sms=int(props.multi_processor_count),
        smem_per_block=int(smem_block),
        smem_per_sm=int(smem_sm),
        regs_per_block=int(regs),
        regs_per_thread=255,
        max_threads_per_block=1024,
        memory_gb=round(int(props.total_memory) / 1024**3, 1),
        bandwidth_gbs=None,
        peak_fp16_tflops=None,
        peak_bf16_tflops=None,
        known=False,
        fp8_tensor_cores=(int(props.major), int(props.minor)) >= (8, 9),
        l2_bytes=int(l2) if l2 else None,
    )


def visible_gpus() -> list[VisibleGpu]:
    """List the CUDA devices visible to torch (empty without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        torch_name = torch.cuda.get_device_name(index)
        spec = match_device_name(torch_name) or spec_from_device(index)
        gpus.append(VisibleGpu(index=index, torch_name=torch_name, spec=spec))
    return gpus


def current_gpu(index: int = 0) -> GpuSpec:
    """Spec of visible device ``index``; RuntimeError if no CUDA GPU is visible."""
    gpus = visible_gpus()
    if not gpus:
        raise RuntimeError("no CUDA GPU is visible")
    for gpu in gpus:
        if gpu.index == index:
            return gpu.spec
    raise RuntimeError(f"CUDA device {index} is not visible (visible: {_describe(gpus)})")


def _describe(gpus: list[VisibleGpu]) -> str:
    return ", ".join(f"cuda:{g.index} {g.torch_name!r} ({g.spec.name})" for g in gpus)


def select_device(name: str) -> VisibleGpu:
    """Return the first visible GPU matching ``name``; GpuNotFoundError otherwise."""
    gpus = visible_gpus()
    try:
        spec = resolve(name)
    except UnknownGpuError:
        # Devices outside the catalogue can be selected by their slug or torch name.
        key = _key(name)
        for gpu in gpus:
            if not gpu.spec.known and key in (_key(gpu.spec.name), _key(gpu.torch_name)):
                return gpu
        raise
    if spec is INTERPRETER:
        raise GpuNotFoundError(
            "the Triton interpreter is not a CUDA device; use --backend interpreter instead"
        )
    if not gpus:
        raise GpuNotFoundError(
            f"cannot select {spec.name}: no CUDA GPU is visible to this process; "
            "use --dry-run or --backend interpreter to run without a GPU"
        )
    for gpu in gpus:
        if gpu.spec.name == spec.name:
            return gpu
    raise GpuNotFoundError(
        f"requested GPU {spec.name} ({spec.display}) is not visible; "
        f"visible GPUs: {_describe(gpus)}"
    )


def _parse_devices(devices: str) -> list[int] | None:
    """`all` -> None; "0,1" -> [0, 1] (repeats dropped); ValueError naming the bad value."""
    text = devices.strip().lower()
    if text == "all":
        return None
    indices: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ValueError(f"--devices {devices!r}: expected 'all' or comma-separated device "
                             "indices such as 0,1")
        if int(part) not in indices:
            indices.append(int(part))
    return indices


def select_devices(devices: str, name: str | None = None,
                   visible: list[VisibleGpu] | None = None) -> list[VisibleGpu]:
    """The visible GPUs that ``devices`` names: ``"all"`` or indices such as ``"0,1"``.

    ``all`` is every visible GPU, or with ``name`` every visible GPU of that model. The devices
    must all be one GPU model (results and tables are per model): GpuNotFoundError names the
    models otherwise, and the visible devices when an index or ``name`` matches none.
    ValueError for a malformed ``devices``.
    """
    indices = _parse_devices(devices)
    gpus = visible_gpus() if visible is None else visible
    spec = None
    if name is not None:
        spec = resolve(name)
        if spec is INTERPRETER:
            raise GpuNotFoundError("the Triton interpreter is not a CUDA device; --devices "
                                   "selects CUDA devices")
    if not gpus:
        raise GpuNotFoundError(
            f"--devices {devices}: no CUDA GPU is visible to this process; the interpreter "
            "backend runs configs on the CPU without --devices")
    by_index = {gpu.index: gpu for gpu in gpus}
    if indices is None:
        chosen = [gpu for gpu in gpus if spec is None or gpu.spec.name == spec.name]
        if not chosen:
            assert spec is not None
            raise GpuNotFoundError(f"--devices all --gpu {name}: no visible {spec.name} "
                                   f"({spec.display}); visible GPUs: {_describe(gpus)}")
    else:
        missing = [i for i in indices if i not in by_index]
        if missing:
            raise GpuNotFoundError(
                f"--devices {devices}: device{'s' if len(missing) > 1 else ''} "
                f"{', '.join(map(str, missing))} not visible; visible GPUs: {_describe(gpus)}")
        chosen = [by_index[i] for i in indices]
        if spec is not None:
            other = [gpu for gpu in chosen if gpu.spec.name != spec.name]
            if other:
                raise GpuNotFoundError(
                    f"--devices {devices} --gpu {name}: not {spec.name}: {_describe(other)}")
    models = {gpu.spec.name for gpu in chosen}
    if len(models) > 1:
        raise GpuNotFoundError(
            f"--devices {devices} selects different GPU models ({', '.join(sorted(models))}): "
            f"{_describe(chosen)}. Results and tables are per GPU model, so one search tunes "
            "one model: give the indices of one model, or --gpu NAME --devices all")
    return chosen


def _num(value: float | None, fmt: str = "g") -> str:
    return "?" if value is None else format(value, fmt)


def _row(spec: GpuSpec, visible: str) -> dict[str, object]:
    major, minor = spec.compute_capability
    return {
        "name": spec.name,
        "display": spec.display,
        "aliases": ", ".join(spec.aliases),
        "cc": f"{major}.{minor}",
        "sms": str(spec.sms),
        "smem_kb": _num(spec.smem_per_block / _KIB),
        "l2_mb": _num(None if spec.l2_bytes is None else spec.l2_bytes / _MIB),
        "regs": str(spec.regs_per_block),
        "bandwidth_gbs": _num(spec.bandwidth_gbs),
        "fp16_tflops": _num(spec.peak_fp16_tflops),
        "bf16_tflops": _num(spec.peak_bf16_tflops),
        "fp8": "yes" if spec.fp8_tensor_cores else "",
        "fp8_tflops": _num(spec.peak_fp8_tflops) if spec.fp8_tensor_cores else "",
        "visible": visible,
        "known": spec.known,
    }


def format_catalogue(visible: list[VisibleGpu]) -> list[dict[str, object]]:
    """Display rows for the catalogue plus any visible GPU outside it.

    All values are strings except ``known`` (bool); ``visible`` lists devices such as
    ``"cuda:0"`` (comma-joined when several match) or is ``""``.
    """
    where: dict[str, list[str]] = {}
    extra: dict[str, GpuSpec] = {}
    for gpu in visible:
        where.setdefault(gpu.spec.name, []).append(f"cuda:{gpu.index}")
        if gpu.spec.name not in _BY_NAME:
            extra.setdefault(gpu.spec.name, gpu.spec)
    specs = [*CATALOGUE, *extra.values()]
    return [_row(spec, ",".join(where.get(spec.name, []))) for spec in specs]
