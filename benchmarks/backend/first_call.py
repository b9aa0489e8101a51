"""The first call of one compiled model in a fresh process: its inference call, or a training
step (forward and backward). With ``--fresh``, Inductor's caches and memlayout's cost cache
are new folders under ``--caches`` (a first call with nothing cached); ``--costs DIR`` keeps
memlayout's cost cache in DIR (warm from an earlier run), Inductor's still fresh. For the
memlayout backend it also prints the report's price line (planning, compiling, verifying,
guarding, and Inductor's own compile of the same graphs).

    python benchmarks/backend/first_call.py memlayout resnet18 fp32 [--task train]
        [--batch 8] [--size 224] [--fresh] [--costs DIR] [--caches DIR] [--again]
        [--calls N]

``--calls N`` then times the next N calls (training steps) together: where the backend's
guard races the ways to run a graph on its calls, what those rounds cost, and how many calls
the race took.

``--again`` then compiles the model a second time in the same process, after
``torch._dynamo.reset()``, and times that first call too: every cache warm, in memory and on
disk (a notebook's second compile, a recompile after a reset).

``benchmarks/backend/first_calls.py`` runs the comparison: each case alternately through
``inductor`` and ``memlayout``, fresh and with the cost cache warm.
"""

import argparse
import os
import sys
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("backend", choices=["memlayout", "inductor"])
    ap.add_argument("model", help="a torchvision model name, or a model spec "
                    "(benchmarks/real_models.py:smp_unet, timm:NAME)")
    ap.add_argument("dtype", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--task", choices=["train", "infer"], default="train")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--fresh", action="store_true", help="new, empty caches")
    ap.add_argument("--costs", help="memlayout's cost cache folder (default: fresh or the user's)")
    ap.add_argument("--caches", default=tempfile.gettempdir(), help="where fresh caches go")
    ap.add_argument("--calls", type=int, default=0, help="then time N more calls together")
    ap.add_argument("--again", action="store_true",
                    help="then compile again in this process after torch._dynamo.reset()")
    args = ap.parse_args()
    if args.fresh:  # before torch reads them
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-",
                                                                  dir=args.caches)
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-", dir=args.caches)
        os.environ["MEMLAYOUT_CACHE_DIR"] = args.costs or tempfile.mkdtemp(prefix="costs-",
                                                                           dir=args.caches)
    elif args.costs:
        os.environ["MEMLAYOUT_CACHE_DIR"] = args.costs

    import torch
    import torchvision

    import memlayout
    from memlayout.dtypes import autocast, parse_dtype
    from memlayout.plan.compilers.backend_plan import NONE_DIFFERS
    from memlayout.tensors import iter_tensors

    torch.set_num_threads(2)
    torch.manual_seed(0)
    kwargs: dict = {}
    if ":" in args.model:  # a spec: its own example input, at --batch and --size
        from memlayout.models import load_model

        built = load_model(args.model, batch=args.batch, image_size=args.size)
        model, x, kwargs = built.module, built.example_input, built.example_kwargs
    else:
        model = torchvision.models.get_model(args.model)
        x = torch.randn(args.batch, 3, args.size, args.size)
    model.train(args.task == "train")
    dtype = None if args.dtype == "fp32" else parse_dtype(args.dtype)

    from torch._dynamo.utils import counters

    def call(compiled: torch.nn.Module) -> None:
        model.zero_grad(set_to_none=True)
        with autocast(torch.device("cpu"), dtype), torch.set_grad_enabled(args.task == "train"):
            out = compiled(*(x if isinstance(x, tuple) else (x,)), **kwargs)
        if args.task == "train":  # every output that needs a gradient (diffusers: a dict)
            sum(t.float().square().mean() for t in iter_tensors(out)
                if isinstance(t, torch.Tensor) and t.requires_grad).backward()

    def first_call(what: str) -> None:
        counters.clear()
        backend = memlayout.backend() if args.backend == "memlayout" else "inductor"
        compiled = torch.compile(model, backend=backend)
        start = time.perf_counter()
        call(compiled)
        seconds = time.perf_counter() - start
        print(f"{args.backend} {args.model} {args.task} {args.dtype}: {what} {seconds:.2f} s")
        aot = counters["aot_autograd"]  # AOTAutograd's cache: each graph hit, missed or refused
        print(f"AOTAutograd's cache: {aot['autograd_cache_hit']} hit, "
              f"{aot['autograd_cache_miss']} missed, {aot['autograd_cache_bypass']} refused")
        if args.backend == "memlayout":
            report = memlayout.backend_report()
            print(report.price())
            print("graphs: " + "; ".join(
                f"{g.graph} {g.ran}, {len(g.differing)} of {len(g.convolutions)} convolutions "
                "planned otherwise than Inductor's rule"
                + (" (no plan made: the convolutions' costs settled it)"
                   if g.verification == NONE_DIFFERS else "") for g in report.graphs))
        if args.calls:
            start = time.perf_counter()
            for _ in range(args.calls):
                call(compiled)
            seconds = time.perf_counter() - start
            print(f"{args.backend} {args.model} {args.task} {args.dtype}: then {args.calls} "
                  f"calls {seconds:.2f} s")
            if args.backend == "memlayout":
                print("races on the calls: " + "; ".join(
                    f"{g.graph} {g.ran}: " + (f"still racing {', '.join(g.racing)}" if g.racing
                                              else f"ended after {g.race_calls} calls"
                                              if g.race_calls else "none")
                    + (f" ({g.plan_later})" if g.plan_later else "")
                    for g in memlayout.backend_report().graphs))
                print(memlayout.backend_report().price())

    first_call("first call")
    if args.again:
        torch._dynamo.reset()
        if args.backend == "memlayout":
            memlayout.backend_report(clear=True)
        model.zero_grad(set_to_none=True)
        first_call("first call again, after torch._dynamo.reset()")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
