"""Tests for fusetune.gpus (no GPU needed)."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from fusetune import gpus
from fusetune.gpus import (
    CATALOGUE,
    INTERPRETER,
    GpuNotFoundError,
    GpuSpec,
    UnknownGpuError,
    VisibleGpu,
    current_gpu,
    format_catalogue,
    match_device_name,
    resolve,
    select_device,
    spec_from_device,
    visible_gpus,
)

CANONICAL = (
    "rtx-3090",
    "rtx-4090",
    "a100-40gb",
    "a100-80gb",
    "l4",
    "h100-sxm",
    "h100-pcie",
    "h200",
    "l40s",
    "a10g",
    "rtx-6000-ada",
    "h100-nvl",
    "h800",
    "h20",
    "gh200",
    "gh200-144gb",
    "b200",
    "rtx-5090",
)


def _visible(index: int, torch_name: str) -> VisibleGpu:
    spec = match_device_name(torch_name)
    assert spec is not None
    return VisibleGpu(index=index, torch_name=torch_name, spec=spec)


def test_catalogue_names_are_the_supported_gpus() -> None:
    assert tuple(spec.name for spec in CATALOGUE) == CANONICAL
    assert all(isinstance(spec, GpuSpec) and spec.known for spec in CATALOGUE)


@pytest.mark.parametrize("name", CANONICAL)
def test_resolve_every_canonical_name(name: str) -> None:
    assert resolve(name).name == name
    assert resolve(name.upper()).name == name


@pytest.mark.parametrize(
    ("alias", "expected"),
    [
        ("3090", "rtx-3090"),
        ("RTX 3090", "rtx-3090"),
        ("rtx_3090", "rtx-3090"),
        ("geforce-rtx-3090", "rtx-3090"),
        ("4090", "rtx-4090"),
        ("H100", "h100-sxm"),
        ("h100 sxm", "h100-sxm"),
        ("H100_PCIE", "h100-pcie"),
        ("a100", "a100-80gb"),
        ("A100-40GB", "a100-40gb"),
        ("L4", "l4"),
        ("h200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA A100-PCIE-40GB", "a100-40gb"),
        ("L40S", "l40s"),
        ("nvidia-l40s", "l40s"),
        ("A10G", "a10g"),
        ("nvidia_a10g", "a10g"),
        ("RTX 6000 Ada", "rtx-6000-ada"),
        ("6000-ada", "rtx-6000-ada"),
        ("rtx-6000-ada-generation", "rtx-6000-ada"),
        ("H100 NVL", "h100-nvl"),
        ("h100-nvl-94gb", "h100-nvl"),
        ("H800", "h800"),
        ("h800-sxm5", "h800"),
        ("H20", "h20"),
        ("h20-96gb", "h20"),
        ("GH200", "gh200"),
        ("gh200-480gb", "gh200"),
        ("grace hopper", "gh200"),
        ("gh200-hbm3e", "gh200-144gb"),
        ("B200", "b200"),
        ("hgx-b200", "b200"),
        ("5090", "rtx-5090"),
        ("RTX 5090", "rtx-5090"),
        ("geforce-rtx-5090", "rtx-5090"),
    ],
)
def test_resolve_aliases_and_device_names(alias: str, expected: str) -> None:
    assert resolve(alias).name == expected


@pytest.mark.parametrize("name", ["interpreter", "CPU", " Interpreter "])
def test_resolve_interpreter(name: str) -> None:
    spec = resolve(name)
    assert spec is INTERPRETER
    assert spec.compute_capability == (0, 0)
    assert spec.sms == 1
    assert spec.smem_per_block == 232448
    assert spec.bandwidth_gbs is None and spec.peak_fp16_tflops is None


@pytest.mark.parametrize("bad", ["rtx-9999", "v100", "", "h300", "l40", "a10", "b100", "h2"])
def test_resolve_unknown_lists_valid_names(bad: str) -> None:
    with pytest.raises(UnknownGpuError) as info:
        resolve(bad)
    message = str(info.value)
    assert repr(bad) in message
    for name in CANONICAL:
        assert name in message
    assert "3090" in message and "interpreter" in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("torch_name", "expected"),
    [
        ("NVIDIA GeForce RTX 3090", "rtx-3090"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100-PCIE-40GB", "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100 80GB PCIe", "a100-80gb"),
        ("nvidia l4", "l4"),
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA H200 NVL", "h200"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA RTX 6000 Ada Generation", "rtx-6000-ada"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H800", "h800"),
        ("NVIDIA H20", "h20"),
        ("NVIDIA GH200 480GB", "gh200"),
        ("NVIDIA GH200 144G HBM3e", "gh200-144gb"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA GeForce RTX 5090", "rtx-5090"),
    ],
)
def test_match_device_name_known(torch_name: str, expected: str) -> None:
    spec = match_device_name(torch_name)
    assert spec is not None
    assert spec.name == expected


@pytest.mark.parametrize(
    "torch_name",
    [
        "Tesla V100-SXM2-16GB",
        "NVIDIA GeForce RTX 3090 Ti",
        "NVIDIA GeForce RTX 4090 Laptop GPU",
        "NVIDIA L40",
        "NVIDIA A10",
        "NVIDIA A40",
        "Quadro RTX 6000",
        "NVIDIA RTX A6000",
        "NVIDIA H800 PCIe",
        "NVIDIA GB200",
        "NVIDIA GeForce RTX 5090 D",
        "NVIDIA GeForce RTX 5090 Laptop GPU",
        "",
    ],
)
def test_match_device_name_unknown(torch_name: str) -> None:
    assert match_device_name(torch_name) is None


def test_datasheet_numbers() -> None:
    r3090 = resolve("3090")
    assert r3090.smem_per_block == 101376
    assert r3090.smem_per_sm == 102400
    assert r3090.compute_capability == (8, 6)
    assert r3090.sms == 82
    assert r3090.bandwidth_gbs == 936
    assert r3090.peak_fp16_tflops == 71
    assert resolve("a100").smem_per_block == 166912
    assert resolve("a100").smem_per_sm == 167936
    assert resolve("h100").smem_per_block == 232448
    assert resolve("h100").sms == 132
    assert resolve("h100-pcie").sms == 114
    assert resolve("h100-pcie").peak_bf16_tflops == 756
    assert resolve("l4").bandwidth_gbs == 300
    assert resolve("4090").compute_capability == (8, 9)
    assert resolve("h200").memory_gb == 141
    # The rate that bounds a point's products: FP8 activations on FP8 tensor cores at the FP8
    # rate, elsewhere (weight-only FP8 included: its weights are upcast) the activations'
    # 16-bit rate.
    h100 = resolve("h100")
    assert h100.peak_tflops("float16", "fp8") == 1979
    assert h100.peak_tflops("bfloat16", "fp8") == 1979
    assert h100.peak_tflops("bfloat16") == h100.peak_bf16_tflops == 989
    assert r3090.peak_tflops("float16", "fp8") == 71  # no FP8 tensor cores
    assert resolve("4090").peak_tflops("float16", "fp8") == 330.3
    assert INTERPRETER.peak_tflops("float16", "fp8") is None
    for spec in CATALOGUE:
        assert spec.regs_per_block == 65536
        assert spec.regs_per_thread == 255
        assert spec.max_threads_per_block == 1024
        assert spec.smem_per_sm - spec.smem_per_block == 1024


def test_datasheet_numbers_of_the_added_gpus() -> None:
    mib = 1024**2
    expected = {  # sms, cc, memory GB, GB/s, fp16 = bf16 TFLOP/s, fp8 TFLOP/s, L2 bytes
        "l40s": (142, (8, 9), 48, 864, 362.05, 733, 96 * mib),
        "a10g": (80, (8, 6), 24, 600, None, None, 6 * mib),
        "rtx-6000-ada": (142, (8, 9), 48, 960, 364.2, 728.5, 96 * mib),
        "h100-nvl": (132, (9, 0), 94, 3900, 835.5, 1670.5, None),
        "h800": (132, (9, 0), 80, 3350, 989, 1979, 50 * mib),
        "h20": (78, (9, 0), 96, 4000, 148, 296, 60 * mib),
        "gh200": (132, (9, 0), 96, 4000, 989, 1979, None),
        "gh200-144gb": (132, (9, 0), 144, 4900, 989, 1979, None),
        "b200": (148, (10, 0), 180, 7700, 2250, 4500, 126 * mib),
        "rtx-5090": (170, (12, 0), 32, 1792, 209.5, 419, 96 * mib),
    }
    for name, (sms, cc, memory, bandwidth, fp16, fp8, l2) in expected.items():
        spec = resolve(name)
        assert (spec.sms, spec.compute_capability, spec.memory_gb, spec.bandwidth_gbs) == (
            sms, cc, memory, bandwidth), name
        assert spec.peak_fp16_tflops == spec.peak_bf16_tflops == fp16, name
        assert spec.peak_fp8_tflops == fp8 and spec.fp8_tensor_cores is (fp8 is not None), name
        assert spec.l2_bytes == l2, name
    assert resolve("h200").l2_bytes == 60 * mib  # what an H200 reports; the H100 has 50 MB
    assert resolve("b200").peak_tflops("bfloat16", "fp8") == 4500
    assert resolve("a10g").peak_tflops("float16") is None  # unpublished: no floor from it


# Shared memory per block (opt-in) and per SM by compute capability, from the CUDA C++
# Programming Guide: the limits a GPU of that capability has, whatever the product.
SMEM_BY_CC = {(8, 0): (163, 164), (8, 6): (99, 100), (8, 9): (99, 100), (9, 0): (227, 228),
              (10, 0): (227, 228), (12, 0): (99, 100)}


@pytest.mark.parametrize("spec", CATALOGUE, ids=lambda s: s.name)
def test_limits_plausible_for_compute_capability(spec: GpuSpec) -> None:
    block_kb, sm_kb = SMEM_BY_CC[spec.compute_capability]
    assert (spec.smem_per_block, spec.smem_per_sm) == (block_kb * 1024, sm_kb * 1024)
    assert (spec.regs_per_block, spec.regs_per_thread, spec.max_threads_per_block) == (
        65536, 255, 1024)
    # FP8 tensor cores from compute capability 8.9 on, twice the 16-bit rate where both are
    # published; TMA from 9.0 on.
    assert spec.fp8_tensor_cores is (spec.compute_capability >= (8, 9))
    if spec.peak_fp8_tflops is not None and spec.peak_fp16_tflops is not None:
        assert spec.peak_fp8_tflops == pytest.approx(2 * spec.peak_fp16_tflops, rel=0.02)
    assert spec.tma is (spec.compute_capability >= (9, 0))
    assert 40 <= spec.sms <= 200
    assert spec.memory_gb is not None and 16 <= spec.memory_gb <= 200
    assert spec.bandwidth_gbs is not None and 250 <= spec.bandwidth_gbs <= 8000
    # The dense 16-bit rate per SM lies between a GeForce Ampere's (about 0.9 TFLOP/s) and a
    # B200's (about 15): a digit too many or too few shows.
    if spec.peak_fp16_tflops is not None:
        assert 0.5 <= spec.peak_fp16_tflops / spec.sms <= 16
    if spec.l2_bytes is not None:
        assert 4 * 1024**2 <= spec.l2_bytes <= 128 * 1024**2
    assert spec.known and resolve(spec.name) is spec
    for label in (*spec.aliases, *spec.device_names):
        assert resolve(label) is spec, label
    for device in spec.device_names:
        assert match_device_name(device) is spec, device


def test_visible_gpus_empty_without_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    assert visible_gpus() == []
    with pytest.raises(RuntimeError, match="no CUDA GPU is visible"):
        current_gpu()


def test_select_device_none_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpus, "visible_gpus", lambda: [])
    with pytest.raises(GpuNotFoundError) as info:
        select_device("3090")
    assert "--dry-run" in str(info.value)
    assert "--backend interpreter" in str(info.value)
    assert "no CUDA GPU is visible" in str(info.value)
    assert isinstance(info.value, RuntimeError)


def test_select_device_wrong_gpu_names_what_it_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpus, "visible_gpus", lambda: [_visible(0, "NVIDIA H100 80GB HBM3")])
    with pytest.raises(GpuNotFoundError) as info:
        select_device("3090")
    message = str(info.value)
    assert "rtx-3090" in message
    assert "NVIDIA H100 80GB HBM3" in message
    assert "cuda:0" in message and "h100-sxm" in message


def test_select_device_picks_matching_index(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = [_visible(0, "NVIDIA GeForce RTX 3090"), _visible(1, "NVIDIA H100 80GB HBM3")]
    monkeypatch.setattr(gpus, "visible_gpus", lambda: seen)
    chosen = select_device("H100")
    assert chosen.index == 1
    assert chosen.spec.name == "h100-sxm"
    assert select_device("rtx 3090").index == 0
    with pytest.raises(UnknownGpuError):
        select_device("v100")


def test_select_device_unknown_visible_by_slug(monkeypatch: pytest.MonkeyPatch) -> None:
    odd = dataclasses.replace(INTERPRETER, name="nvidia-a40", display="NVIDIA A40", known=False)
    seen = [VisibleGpu(index=0, torch_name="NVIDIA A40", spec=odd)]
    monkeypatch.setattr(gpus, "visible_gpus", lambda: seen)
    assert select_device("nvidia-a40").index == 0
    assert select_device("NVIDIA A40").index == 0


def test_current_gpu_uses_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = [_visible(0, "NVIDIA L4"), _visible(1, "NVIDIA H200")]
    monkeypatch.setattr(gpus, "visible_gpus", lambda: seen)
    assert current_gpu().name == "l4"
    assert current_gpu(1).name == "h200"
    with pytest.raises(RuntimeError, match="cuda:1"):
        current_gpu(5)


def test_format_catalogue_marks_visible() -> None:
    seen = [_visible(0, "NVIDIA GeForce RTX 3090")]
    rows = {row["name"]: row for row in format_catalogue(seen)}
    assert list(rows) == list(CANONICAL)
    r3090 = rows["rtx-3090"]
    assert r3090["visible"] == "cuda:0"
    assert r3090["cc"] == "8.6"
    assert r3090["sms"] == "82"
    assert r3090["smem_kb"] == "99"
    assert r3090["regs"] == "65536"
    assert r3090["bandwidth_gbs"] == "936"
    assert r3090["fp16_tflops"] == "71"
    assert r3090["aliases"] == "3090, rtx3090, geforce-rtx-3090"
    assert rows["h100-sxm"]["visible"] == ""
    assert rows["h100-sxm"]["smem_kb"] == "227"
    assert rows["rtx-4090"]["fp16_tflops"] == "165.2"


def test_format_catalogue_unknown_visible_gets_own_row() -> None:
    odd = dataclasses.replace(
        INTERPRETER,
        name="nvidia-a40",
        display="NVIDIA A40",
        compute_capability=(8, 6),
        known=False,
    )
    seen = [
        VisibleGpu(index=0, torch_name="NVIDIA A40", spec=odd),
        _visible(1, "NVIDIA H100 80GB HBM3"),
        _visible(2, "NVIDIA H100 80GB HBM3"),
    ]
    rows = format_catalogue(seen)
    assert len(rows) == len(CATALOGUE) + 1
    last = rows[-1]
    assert last["name"] == "nvidia-a40"
    assert last["known"] is False
    assert last["visible"] == "cuda:0"
    assert last["cc"] == "8.6"
    assert last["bandwidth_gbs"] == "?"
    by_name = {row["name"]: row for row in rows}
    assert by_name["h100-sxm"]["visible"] == "cuda:1,cuda:2"


def _fake_torch(props: object, name: str) -> types.ModuleType:
    cuda = types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 1,
        get_device_name=lambda index: name,
        get_device_properties=lambda index: props,
    )
    module = types.ModuleType("torch")
    module.cuda = cuda  # type: ignore[attr-defined]
    return module


def test_spec_from_device_with_fake_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    props = types.SimpleNamespace(
        name="NVIDIA A40",
        major=8,
        minor=6,
        multi_processor_count=84,
        total_memory=48 * 1024**3,
        shared_memory_per_block_optin=101376,
        shared_memory_per_multiprocessor=102400,
        regs_per_multiprocessor=65536,
        L2_cache_size=6 * 1024**2,
    )
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(props, "NVIDIA A40"))
    spec = spec_from_device(0)
    assert spec.name == "nvidia-a40"
    assert spec.known is False
    assert spec.compute_capability == (8, 6)
    assert spec.sms == 84
    assert spec.smem_per_block == 101376
    assert spec.smem_per_sm == 102400
    assert spec.memory_gb == 48.0
    assert spec.l2_bytes == 6 * 1024**2
    assert spec.bandwidth_gbs is None and spec.peak_bf16_tflops is None
    (gpu,) = visible_gpus()
    assert gpu.index == 0 and gpu.spec == spec


def test_spec_from_device_smem_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    props = types.SimpleNamespace(
        name="Some GPU", major=7, minor=5, multi_processor_count=40, total_memory=16 * 1024**3
    )
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(props, "Some GPU"))
    monkeypatch.setitem(sys.modules, "triton", None)  # make `import triton` fail
    spec = spec_from_device(0)
    assert spec.smem_per_block == 49152
    assert spec.regs_per_block == 65536
    assert spec.name == "some-gpu"
    assert spec.l2_bytes is None


def test_visible_gpus_known_device_uses_catalogue(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(None, "NVIDIA A100-SXM4-80GB"))
    (gpu,) = visible_gpus()
    assert gpu.spec is resolve("a100-80gb")
    assert gpu.torch_name == "NVIDIA A100-SXM4-80GB"
