"""Every verb rejects a bad flag before it does any work, in one wording, and states the
conditions before it times anything."""

from __future__ import annotations

import textwrap

import pytest
import torch
from typer.testing import CliRunner

from memlayout.cli import app

BUILT = "the model was built"  # what the factory below raises: the work has started


@pytest.fixture
def models(tmp_path):
    """A spec whose model raises when built, and a tiny one that runs."""
    path = tmp_path / "net.py"
    path.write_text(textwrap.dedent(f"""
        from torch import nn

        def boom():
            raise RuntimeError({BUILT!r})

        def tiny():
            return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    """))
    return path


def _run(*args: str):
    return CliRunner().invoke(app, list(args))


def _rejected(result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert text.startswith("error: "), text
    for w in words:
        assert w in text, text
    assert BUILT not in text and "Traceback" not in text


def test_audit_rejects_a_bad_dtype_before_building_the_model(models):
    _rejected(_run("audit", f"{models}:boom", "--dtype", "fp8"), "dtype 'fp8' is not supported")


def test_audit_rejects_a_bad_format_and_sizes_before_building_the_model(models):
    _rejected(_run("audit", f"{models}:boom", "--format", "nhcw"), "unknown memory format 'nhcw'")
    _rejected(_run("audit", f"{models}:boom", "--batch", "0"), "--batch must be >= 1, got 0")
    _rejected(_run("audit", f"{models}:boom", "--image-size", "-3"), "--image-size must be >= 1")


def test_inspect_rejects_a_bad_batch_and_device_before_building_the_model(models):
    _rejected(_run("inspect", f"{models}:boom", "--batch", "0"), "--batch must be >= 1, got 0")
    _rejected(_run("inspect", f"{models}:boom", "--device", "tpu"), "unknown device 'tpu'")


def test_bench_rejects_a_dtype_it_does_not_run_before_its_header(models, tmp_path):
    result = _run("bench", f"{models}:boom", "--dtype", "fp32,fp16", "--out", str(tmp_path / "o"))
    _rejected(result, "dtype 'fp16' is not supported; use fp32 or bf16")
    assert "memlayout bench" not in result.output and not (tmp_path / "o").exists()


def test_bench_accepts_long_dtype_names(models, tmp_path):
    from memlayout.cli.common import BENCH_DTYPES, check_dtypes

    assert check_dtypes("float32, bfloat16", BENCH_DTYPES) == "fp32,bf16"


def test_train_rejects_a_bad_dtype_before_writing_the_data(models, tmp_path):
    data = tmp_path / "ds"
    result = _run("train", f"{models}:boom", "--data", str(data), "--synthetic", "8",
                  "--dtype", "fp8")
    _rejected(result, "dtype 'fp8' is not supported")
    assert not data.exists()
    result = _run("train", f"{models}:boom", "--data", str(data), "--synthetic", "8",
                  "--compare", "nchw,nhcw")
    _rejected(result, "'nhcw'", "nchw, nhwc, planned")
    assert not data.exists()


def test_bench_data_rejects_bad_sizes_before_writing_images(tmp_path):
    result = _run("bench-data", "--batch", "0", "--cache-dir", str(tmp_path / "jpegs"))
    _rejected(result, "--batch must be >= 1, got 0")
    assert "JPEGs" not in result.output and not (tmp_path / "jpegs").exists()


def test_coverage_rejects_a_bad_flag_before_loading_opinfo(tmp_path):
    for args, words in ((["--dtype", "float33"], "float33"), (["--device", "tpu"], "unknown device 'tpu'"),
                        (["--max-samples", "0"], "--max-samples must be >= 1")):
        result = _run("coverage", "--out", str(tmp_path / "o"), *args)
        _rejected(result, words)
        assert "OpInfo" not in result.output and not (tmp_path / "o").exists()


def test_one_wording_for_a_bad_dtype_across_verbs(models, tmp_path):
    lines = {verb: " ".join(_run(*args).output.split()) for verb, args in {
        "audit": ("audit", f"{models}:boom", "--dtype", "fp8"),
        "train": ("train", f"{models}:boom", "--data", str(tmp_path), "--dtype", "fp8"),
    }.items()}
    assert len(set(lines.values())) == 1, lines


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("verb", ["audit", "inspect", "bench", "train", "coverage", "bench-data"])
def test_cuda_without_cuda_is_a_clear_error(verb, models, tmp_path):
    args = {"coverage": ["coverage", "--out", str(tmp_path / "o")],
            "bench-data": ["bench-data", "--cache-dir", str(tmp_path / "jpegs")],
            "train": ["train", f"{models}:boom", "--data", str(tmp_path / "ds")],
            "bench": ["bench", f"{models}:boom", "--out", str(tmp_path / "o")]}.get(
        verb, [verb, f"{models}:boom"])
    _rejected(_run(*args, "--device", "cuda"), "CUDA is not available here", "--device cpu")


def test_audit_overhead_states_the_conditions_first(models):
    result = _run("audit", f"{models}:tiny", "--batch", "2", "--image-size", "8", "--overhead",
                  "--rounds", "1")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("conditions: load ") and "OMP_WAIT_POLICY=" in lines[0]
    assert "median per-round ratio" in result.output


@pytest.fixture
def cudnn_flags():
    """cuDNN's global flags settable, as in a user's process (torch's own test helpers, which
    the coverage tests import, freeze them), and as they were afterwards."""
    allow = getattr(torch.backends, "__allow_nonbracketed_mutation")
    before = torch.backends.cudnn.benchmark
    with allow():
        yield
        torch.backends.cudnn.benchmark = before


@pytest.mark.parametrize("verb", ["optimize", "bench"])
def test_cudnn_benchmark_is_set_before_any_work(verb, models, cudnn_flags, tmp_path):
    """``--cudnn-benchmark`` sets torch's flag (the seam keys costs by it) before the model is
    built, so even a model that fails to build leaves it set; without it the flag is left as
    the caller had it."""
    torch.backends.cudnn.benchmark = False
    extra = ["--out", str(tmp_path / "o")] if verb == "bench" else []
    _run(verb, f"{models}:boom", "--cudnn-benchmark", *extra)
    assert torch.backends.cudnn.benchmark is True
    torch.backends.cudnn.benchmark = False
    _run(verb, f"{models}:boom", *extra)
    assert torch.backends.cudnn.benchmark is False
