"""Peer inference runtimes (L2): OpenVINO and ONNX Runtime as callables on torch tensors.

On CPUs these runtimes run convolutions in blocked formats (nChw16c and friends) that PyTorch's
strided layouts cannot express, so they are measured candidates beside eager, torch.compile and
memlayout's plans. Each adapter converts the model once and returns a callable that takes the
model's NCHW-shaped input tensor and returns torch tensors, so it times and verifies like any
other mode.

- ``openvino``: ``openvino.convert_model(module, example_input=x)``, compiled for the CPU plugin
  with ``INFERENCE_PRECISION_HINT`` ``f32`` or ``bf16``: bf16 is OpenVINO's own bf16 execution
  (weights and activations in bf16 inside the runtime; inputs and outputs stay fp32), not
  ``torch.autocast``.
- ``mkldnn``: PyTorch's own oneDNN blocked path, ``torch.utils.mkldnn.to_mkldnn`` (prepacked
  convolution weights, ``nChw16c`` activations between them): the whole model runs on mkldnn
  tensors, one ``to_mkldnn`` in and one ``to_dense`` out. Only models whose every op has an
  mkldnn kernel (no ``ReLU6``/``hardtanh``, so no MobileNet) run; for the others it is
  unavailable, with the op named. bf16: weights and activations cast to bf16 once. Not a bench
  mode (``RUNTIMES`` are the peers), a ``memlayout.compile`` candidate.
- ``onnxruntime``: ``torch.onnx.export(..., dynamo=True)`` (the torch.export-based exporter;
  the TorchScript one is deprecated) and an ``InferenceSession`` on the CPU execution provider
  with ``ORT_ENABLE_ALL``. fp32 only: the CPU provider has no bf16 convolution kernel (checked
  against the installed onnxruntime each time bf16 is asked for).

``input_layout="nhwc"`` exports the model with an NHWC input (a permute folded in front of the
first op), so a pipeline that holds HWC images (memlayout.data's channels-last batches) feeds it
without a transpose: the callable then reads a channels-last tensor's memory as it is.

Both runtimes are the optional extra ``memlayout[runtimes]``; without them ``build_runtime``
raises ``RuntimeUnavailable`` naming the install command.

>>> import torch
>>> from torch import nn
>>> m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
>>> rt = build_runtime(m, torch.randn(1, 3, 8, 8), RuntimeOptions("openvino"))  # doctest: +SKIP
>>> tuple(rt(torch.randn(1, 3, 8, 8)).shape)  # doctest: +SKIP
(1, 4, 6, 6)
"""

from __future__ import annotations

import copy
import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from memlayout.errors import MemlayoutError

RUNTIMES: tuple[str, ...] = ("openvino", "onnxruntime")  # the peers: bench modes too
MKLDNN = "mkldnn"
ADAPTERS: tuple[str, ...] = (*RUNTIMES, MKLDNN)  # every runtime build_runtime converts for
#: settings of a runtime's session beyond its defaults (a cached comparison is for these)
SETTINGS: dict[str, str] = {"onnxruntime": "session.intra_op.allow_spinning=0"}
INPUT_LAYOUTS: tuple[str, ...] = ("nchw", "nhwc")
INSTALL = "pip install 'memlayout[runtimes]'"
#: the Python packages each runtime needs (the extra installs them all)
_PACKAGES: dict[str, tuple[str, ...]] = {
    "openvino": ("openvino",),
    "onnxruntime": ("onnxruntime", "onnx", "onnxscript"),
}

Output = torch.Tensor | tuple[torch.Tensor, ...]


class RuntimeUnavailable(MemlayoutError):
    """A runtime that cannot run here: not installed, or without kernels for the dtype."""


@dataclass(frozen=True)
class RuntimeOptions:
    """Which runtime, in which precision, fed which input layout, on how many threads."""

    runtime: str
    #: ``None``: fp32; ``torch.bfloat16``: the runtime's own bf16 (from ``parse_dtype``)
    dtype: torch.dtype | None = None
    #: ``nchw``: the model as exported; ``nhwc``: exported with an NHWC input
    input_layout: str = "nchw"
    #: intra-op threads; ``None``: torch's current setting, so every mode gets the same cores
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.runtime not in ADAPTERS:
            raise ValueError(f"unknown runtime {self.runtime!r}; expected one of {', '.join(ADAPTERS)}")
        if self.input_layout not in INPUT_LAYOUTS:
            raise ValueError(f"unknown input layout {self.input_layout!r}; expected nchw or nhwc")
        if self.dtype not in (None, torch.bfloat16):
            raise ValueError(f"dtype {self.dtype} not supported by the runtime adapters; fp32 or bf16")


@dataclass(frozen=True)
class RuntimeModel:
    """A converted model: call it with the NCHW-shaped input, get torch tensors back."""

    options: RuntimeOptions
    run: Callable[[torch.Tensor], Output]
    #: what the runtime computes in, in words (recorded beside every timing)
    precision: str
    #: how the torch model became the runtime's graph
    converter: str
    version: str
    threads: int
    convert_s: float
    compile_s: float

    def __call__(self, x: torch.Tensor) -> Output:
        return self.run(x)

    def describe(self) -> str:
        return (f"{self.options.runtime} {self.version}: {self.converter}; {self.precision}; "
                f"{self.options.input_layout.upper()} input; {self.threads} threads; "
                f"convert {self.convert_s:.1f} s, compile {self.compile_s:.1f} s")


def available(runtime: str) -> str | None:
    """``None`` when ``runtime`` can be imported, else why not (with the install command)."""
    if runtime == MKLDNN:
        ok = hasattr(torch.Tensor, "to_mkldnn") and torch.backends.mkldnn.is_available()
        return None if ok else "this torch build has no mkldnn (oneDNN) tensors"
    try:
        for package in _PACKAGES[runtime]:
            _import(package)
    except RuntimeUnavailable as exc:
        return str(exc)
    return None


def build_runtime(module: nn.Module, example: torch.Tensor, options: RuntimeOptions) -> RuntimeModel:
    """Convert ``module`` (inference) for ``options.runtime``; ``example`` is an NCHW-shaped
    input. Raises ``RuntimeUnavailable`` when the runtime or its dtype is missing here."""
    model = copy.deepcopy(module).eval()
    threads = options.threads or torch.get_num_threads()
    if options.input_layout == "nhwc":
        model = _NHWCInput(model).eval()
    sample = _as_runtime_input(example, options.input_layout)
    if options.runtime == "openvino":
        return _openvino(model, sample, options, threads)
    if options.runtime == MKLDNN:
        return _mkldnn(model, sample, options, threads)
    return _onnxruntime(model, sample, options, threads)


class _NHWCInput(nn.Module):
    """The model behind a permute: takes (N, H, W, C), which the exporters fold into the first
    op's input, so the caller's HWC memory is read as it is."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> object:
        return self.model(x.permute(0, 3, 1, 2))


def _as_runtime_input(x: torch.Tensor, layout: str) -> torch.Tensor:
    # a channels-last NCHW-shaped tensor permuted to NHWC is already contiguous: no copy
    x = x.detach().float().cpu()
    return x.permute(0, 2, 3, 1).contiguous() if layout == "nhwc" else x.contiguous()


def _openvino(model: nn.Module, sample: torch.Tensor, options: RuntimeOptions,
              threads: int) -> RuntimeModel:
    ov = _import("openvino")
    start = time.perf_counter()
    with torch.no_grad():
        graph = ov.convert_model(model, example_input=sample)
    convert_s = time.perf_counter() - start
    hint = "bf16" if options.dtype is torch.bfloat16 else "f32"
    start = time.perf_counter()
    # LATENCY: one stream on all the given threads, as the torch modes run one batch at a time
    compiled = ov.Core().compile_model(graph, "CPU", {
        "INFERENCE_PRECISION_HINT": hint, "INFERENCE_NUM_THREADS": threads,
        "PERFORMANCE_HINT": "LATENCY"})
    compile_s = time.perf_counter() - start
    granted = str(compiled.get_property("INFERENCE_PRECISION_HINT"))
    if hint == "bf16" and "bf16" not in granted and "bfloat16" not in granted:
        raise RuntimeUnavailable(f"OpenVINO's CPU plugin runs {granted} where bf16 was asked "
                                 "(no bf16 support on this CPU)")
    request = compiled.create_infer_request()
    n_outputs = len(compiled.outputs)

    def run(x: torch.Tensor) -> Output:
        request.infer({0: _as_runtime_input(x, options.input_layout).numpy()}, share_inputs=True)
        # the request reuses its output buffers on the next call: copy out
        outs = tuple(torch.from_numpy(request.get_output_tensor(i).data.copy())
                     for i in range(n_outputs))
        return outs[0] if n_outputs == 1 else outs

    precision = ("OpenVINO bf16 (INFERENCE_PRECISION_HINT=bf16, the runtime's own bf16; "
                 "fp32 inputs and outputs)" if hint == "bf16"
                 else "fp32 (INFERENCE_PRECISION_HINT=f32)")
    return RuntimeModel(options, run, precision, "openvino.convert_model(example_input=...)",
                        ov.__version__, threads, convert_s, compile_s)


def _onnxruntime(model: nn.Module, sample: torch.Tensor, options: RuntimeOptions,
                 threads: int) -> RuntimeModel:
    ort = _import("onnxruntime")
    for package in _PACKAGES["onnxruntime"][1:]:
        _import(package)
    if options.dtype is torch.bfloat16:
        reason = _ort_bf16_conv_missing(ort)
        if reason:
            raise RuntimeUnavailable(f"ONNX Runtime {ort.__version__}: the CPU execution provider "
                                     f"has no bf16 convolution ({reason}); fp32 only")
        raise RuntimeUnavailable(f"ONNX Runtime {ort.__version__} accepts bf16 convolutions, "
                                 "but memlayout's adapter exports fp32 only")
    start = time.perf_counter()
    with torch.no_grad():
        program = torch.onnx.export(model, (sample,), dynamo=True, verbose=False,
                                    input_names=["input"])
    proto = program.model_proto.SerializeToString()
    convert_s = time.perf_counter() - start
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    # ONNX Runtime's threads spin after each run by default: beside other work in the process
    # (PyTorch ops, another mode of an interleaved benchmark) they take the cores it needs.
    # mobilenet_v2, batch 8, 2 threads, two sessions and eager NHWC interleaved: 38-43 ms a
    # call spinning, 33-34 ms not (docs/benchmarks.md).
    key, value = SETTINGS["onnxruntime"].split("=")
    opts.add_session_config_entry(key, value)
    start = time.perf_counter()
    session = ort.InferenceSession(proto, opts, providers=["CPUExecutionProvider"])
    compile_s = time.perf_counter() - start
    name = session.get_inputs()[0].name

    def run(x: torch.Tensor) -> Output:
        outs = tuple(torch.from_numpy(o) for o in
                     session.run(None, {name: _as_runtime_input(x, options.input_layout).numpy()}))
        return outs[0] if len(outs) == 1 else outs

    return RuntimeModel(options, run, "fp32 (CPUExecutionProvider, ORT_ENABLE_ALL)",
                        "torch.onnx.export(dynamo=True)", ort.__version__, threads, convert_s,
                        compile_s)


class _OnMkldnn(nn.Module):
    """``model`` (converted by ``torch.utils.mkldnn.to_mkldnn``) on mkldnn tensors: one
    ``to_mkldnn`` in, ``to_dense`` (fp32) out."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, x: torch.Tensor) -> Output:
        out = self.model(x.to(self.dtype).to_mkldnn())
        outs = out if isinstance(out, tuple) else (out,)
        dense = tuple(o.to_dense().float() for o in outs)
        return dense[0] if len(dense) == 1 else dense


def _mkldnn(model: nn.Module, sample: torch.Tensor, options: RuntimeOptions,
            threads: int) -> RuntimeModel:
    reason = available(MKLDNN) or ("mkldnn tensors cannot be permuted: NCHW input only"
                                   if options.input_layout == "nhwc" else None)
    if reason:
        raise RuntimeUnavailable(reason)
    from torch.utils import mkldnn

    dtype = options.dtype or torch.float32
    start = time.perf_counter()
    blocked = _OnMkldnn(mkldnn.to_mkldnn(model, dtype), dtype).eval()  # model: a copy already
    convert_s = time.perf_counter() - start
    start = time.perf_counter()
    try:  # the first call is where an op without an mkldnn kernel shows
        with torch.no_grad():
            blocked(sample)
    except (NotImplementedError, RuntimeError) as exc:
        raise RuntimeUnavailable("not every op of this model runs on mkldnn tensors: "
                                 f"{str(exc).splitlines()[0][:160]}") from exc
    compile_s = time.perf_counter() - start

    def run(x: torch.Tensor) -> Output:
        with torch.no_grad():
            return blocked(_as_runtime_input(x, options.input_layout))

    precision = ("bf16 weights and activations (to_mkldnn(model, torch.bfloat16)); fp32 inputs "
                 "and outputs" if dtype is torch.bfloat16 else "fp32")
    return RuntimeModel(options, run, f"oneDNN blocked {precision}",
                        "torch.utils.mkldnn.to_mkldnn", torch.__version__, threads, convert_s,
                        compile_s)


def _ort_bf16_conv_missing(ort: ModuleType) -> str:
    """Why this onnxruntime cannot run a bf16 Conv on the CPU (empty: it can), from a one-node
    model built on the spot: the answer of the installed version, not a remembered one."""
    onnx = _import("onnx")
    helper, bf16 = onnx.helper, onnx.TensorProto.BFLOAT16
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"])], "bf16_conv",
        [helper.make_tensor_value_info("x", bf16, [1, 1, 3, 3]),
         helper.make_tensor_value_info("w", bf16, [1, 1, 1, 1])],
        [helper.make_tensor_value_info("y", bf16, [1, 1, 3, 3])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    try:
        ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as exc:  # the runtime's refusal is the answer
        return str(exc).splitlines()[0][:200]
    return ""


def _import(package: str) -> ModuleType:
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise RuntimeUnavailable(f"{package} is not installed ({exc}); install the runtimes "
                                 f"with: {INSTALL}") from exc
