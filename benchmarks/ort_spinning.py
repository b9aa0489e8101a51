"""Do ONNX Runtime's spinning threads cost the work beside them? Two sessions of one model
(the bench's peer mode and memlayout.compile's candidate are two such) and eager NHWC, timed
interleaved in one process, with ONNX Runtime's default (threads spin after a run) and with
``session.intra_op.allow_spinning=0``; medians per call and the two sessions' per-round ratio
(1: no difference between two identical sessions).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/ort_spinning.py --rounds 15
"""

from __future__ import annotations

import argparse
import statistics

import onnxruntime as ort
import torch
import torchvision

from memlayout.timing import interleaved


def session(proto: bytes, x: torch.Tensor, threads: int, spin: bool):
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    if not spin:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    s = ort.InferenceSession(proto, opts, providers=["CPUExecutionProvider"])
    feed = {s.get_inputs()[0].name: x.numpy()}
    return lambda: s.run(None, feed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = torchvision.models.mobilenet_v2().eval()
    x = torch.randn(args.batch, 3, 224, 224)
    with torch.no_grad():
        proto = torch.onnx.export(model, (x,), dynamo=True, verbose=False,
                                  input_names=["input"]).model_proto.SerializeToString()
    nhwc = model.to(memory_format=torch.channels_last)
    x_nhwc = x.contiguous(memory_format=torch.channels_last)

    def eager() -> None:
        with torch.no_grad():
            nhwc(x_nhwc)

    for spin in (True, False):
        c = interleaved({"ort_a": session(proto, x, args.threads, spin),
                         "ort_b": session(proto, x, args.threads, spin), "eager_nhwc": eager},
                        rounds=args.rounds, warmup=2, baseline="ort_a")
        r = c.per_round("ort_a", "ort_b")
        medians = {k: f"{1000 * statistics.median(c[k].times):.1f} ms" for k in c.modes}
        print(f"{'spinning' if spin else 'allow_spinning=0'}: {medians}; ort_a / ort_b time "
              f"{statistics.median(r):.3f} ({min(r):.2f}-{max(r):.2f})")


if __name__ == "__main__":
    main()
