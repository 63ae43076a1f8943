"""A transformers Llama patched by tileops, RoPE alone and RoPE with the RMSNorms, against the same
model unpatched: compiled and eager ``generate``, and an eager training step, side by side in one run.

    python -m benchmarks.hf_generate            # on a GPU: writes results/hf_generate.{json,md}
    python -m benchmarks.hf_generate --quick    # small sizes, CPU or GPU: prints the table only

The model: Llama, 8 layers, hidden 1024, 16 query / 4 key-value heads (head_dim 64), intermediate
2816 (about 8/3 x hidden rounded to 256, Llama's proportion), vocabulary 32000, bf16 on CUDA,
random weights from the config. Three copies with the same weights, so that all stay compiled side
by side (``tileops.integrations.transformers.patch``):

* ``unpatched``: transformers' own modules;
* ``rope``: ``patch(model, norm=False)``, the RoPE alone;
* ``rope+norm``: ``patch(model, rope=True, norm=True)`` (``patch(model)``), RoPE and the 17
  LlamaRMSNorm modules (two per layer and the final one) through ``tileops.norm.RMSNormFwdOp``.

Rows (each a median of ``--reps`` timings after warm-up, the variants in turn, their order
reversed every other run so that all see the same noise; the ratios are ``rope`` / ``unpatched``,
``rope+norm`` / ``unpatched`` and ``rope+norm`` / ``rope``):

* compiled generate: ``model.forward = torch.compile(model.forward)`` (Inductor, default mode),
  ``cache_implementation="static"``, greedy, batch 8 x (256 prompt + 128 new tokens), with
  ``disable_compile=True`` so that this is the only compile (HF would otherwise compile
  ``__call__`` again with its own CompileConfig). The graphs each model compiled are counted
  (Dynamo's ``unique_graphs``): before the patch was traceable, the patched model recompiled at
  every decode step until the recompile limit. (Inductor fuses HF's RMSNorm with its neighbours;
  the routed norm is a custom op it cannot fuse into: this row says which wins.)
* eager generate: the same generation with the default (dynamic) cache, nothing compiled;
* eager training step: forward with labels and backward, batch 4 x 2048.

``--quick`` (2 layers, hidden 64, batch 2 x (16 + 8), training 2 x 64, backend ``aot_eager`` on the
CPU, fp32) only checks that the script runs; it writes no results unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent

FULL = dict(layers=8, hidden=1024, heads=16, kv_heads=4, intermediate=2816, vocab=32000, batch=8, prompt=256,
            new=128, train_batch=4, train_seq=2048)
QUICK = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=128, batch=2, prompt=16, new=8,
             train_batch=2, train_seq=64)


#: the variants: the keyword arguments of ``patch``, None for the unpatched model
VARIANTS: dict[str, dict | None] = {"unpatched": None, "rope": {"rope": True, "norm": False},
                                   "rope+norm": {"rope": True, "norm": True}}
#: the ratios each row reports: (numerator, denominator)
RATIOS = (("rope", "unpatched"), ("rope+norm", "unpatched"), ("rope+norm", "rope"))


def _models(size: dict, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """One Llama per :data:`VARIANTS`, all with the same random weights, patched as each says."""
    import transformers

    from tileops.integrations.transformers import patch

    cfg = transformers.LlamaConfig(
        vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=size["intermediate"],
        num_hidden_layers=size["layers"], num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"],
        max_position_embeddings=max(4096, size["train_seq"]), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    models = {}
    for name, how in VARIANTS.items():
        torch.manual_seed(0)
        # built in dtype as from_pretrained(dtype=...) builds it: the rotary inv_freq stays fp32
        m = transformers.LlamaForCausalLM._from_config(cfg, dtype=dtype).to(device).eval()
        models[name] = m if how is None else patch(m, **how)
    return models


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _side_by_side(calls: dict[str, Callable[[], Any]], device: torch.device, warmup: int,
                  reps: int) -> dict[str, dict]:
    """Median ms of each call, the calls alternating; the graphs Dynamo compiled during each."""
    graphs = dict.fromkeys(calls, 0)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(warmup + reps):
        for name, call in calls.items() if i % 2 == 0 else reversed(list(calls.items())):
            before = _graphs()
            _sync(device)
            t0 = time.perf_counter()
            call()
            _sync(device)
            if i >= warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)
            graphs[name] += _graphs() - before
    return {name: {"ms": statistics.median(ts), "min_ms": min(ts), "max_ms": max(ts), "graphs_compiled": graphs[name]}
            for name, ts in times.items()}


def run(size: dict, device: torch.device, backend: str, warmup: int, reps: int) -> list[dict]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    models = _models(size, device, dtype)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, size["vocab"], (size["batch"], size["prompt"]), generator=gen).to(device)
    n = size["new"]
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                  pad_token_id=0)
    rows = []

    def generate(model, **extra):
        with torch.no_grad():
            return model.generate(prompt, **kwargs, **extra)

    def each(call: Callable[[Any], Any]) -> dict[str, Callable[[], Any]]:
        return {name: (lambda m=m: call(m)) for name, m in models.items()}

    shape = f"{size['batch']} x ({size['prompt']} + {n})"
    torch._dynamo.reset()
    for m in models.values():
        m.forward = torch.compile(m.forward, backend=backend)
    try:
        got = _side_by_side(each(lambda m: generate(m, cache_implementation="static", disable_compile=True)),
                            device, warmup, reps)
    finally:
        for m in models.values():
            del m.forward
    rows.append({"setup": f"compiled generate ({backend}, static cache), {shape}", **_row(got)})

    got = _side_by_side(each(generate), device, warmup, reps)
    rows.append({"setup": f"eager generate (dynamic cache), {shape}", **_row(got)})

    ids = torch.randint(3, size["vocab"], (size["train_batch"], size["train_seq"]), generator=gen).to(device)

    def train_step(model):
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    for m in models.values():
        m.train()
    got = _side_by_side(each(train_step), device, warmup, reps)
    rows.append({"setup": f"eager training step (forward + backward), {size['train_batch']} x {size['train_seq']}",
                 **_row(got)})
    return rows


def _row(got: dict[str, dict]) -> dict:
    return {"times": got, "ratios": {f"{a} / {b}": got[a]["ms"] / got[b]["ms"] for a, b in RATIOS}}


def markdown(rows: list[dict], info: dict) -> str:
    names = list(VARIANTS)
    ratios = [f"{a} / {b}" for a, b in RATIOS]
    lines = [f"Llama {info['size']['layers']} layers, hidden {info['size']['hidden']}, "
             f"{info['size']['heads']}/{info['size']['kv_heads']} heads, intermediate {info['size']['intermediate']}, "
             f"{info['dtype']}, random weights; {info['device']}; torch {info['torch']}, transformers "
             f"{info['transformers']}. Medians of {info['reps']} after {info['warmup']} warm-up runs, the variants "
             f"in turn; rope: patch(model, norm=False), rope+norm: patch(model, rope=True, norm=True); a ratio "
             f"below 1: the first faster.", "",
             f"| setup | {' | '.join(f'{n} ms' for n in names)} | {' | '.join(ratios)} | graphs compiled "
             f"({' / '.join(names)}) |",
             f"|---|{'---:|' * (len(names) + len(ratios) + 1)}"]
    for r in rows:
        t = r["times"]
        ms = " | ".join(f"{t[n]['ms']:.1f}" for n in names)
        rs = " | ".join(f"{r['ratios'][k]:.2f}" for k in ratios)
        graphs = " / ".join(str(t[n]["graphs_compiled"]) for n in names)
        lines.append(f"| {r['setup']} | {ms} | {rs} | {graphs} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf_generate")
    p.add_argument("--quick", action="store_true", help="small sizes (runs on the CPU); writes only with --out")
    p.add_argument("--out", default=None, help="where hf_generate.json/.md go (default benchmarks/results for a "
                                               "full run on a GPU)")
    p.add_argument("--backend", default=None, help="torch.compile backend (default inductor on CUDA, aot_eager on the CPU)")
    p.add_argument("--reps", type=int, default=None, help="timed runs per variant (default 10; --quick 2)")
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not args.quick and device.type != "cuda":
        print("the full benchmark needs a CUDA GPU (--quick runs on the CPU)", file=sys.stderr)
        return 2
    import transformers

    size = QUICK if args.quick else FULL
    backend = args.backend or ("inductor" if device.type == "cuda" else "aot_eager")
    reps = args.reps or (2 if args.quick else 10)
    rows = run(size, device, backend, args.warmup, reps)
    info = {"size": size, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
            "dtype": "bf16" if device.type == "cuda" else "fp32", "torch": torch.__version__,
            "transformers": transformers.__version__, "backend": backend, "reps": reps, "warmup": args.warmup}
    md = markdown(rows, info)
    print(md)
    out = args.out or (None if args.quick else str(HERE / "results"))
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "hf_generate.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
        (Path(out) / "hf_generate.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
