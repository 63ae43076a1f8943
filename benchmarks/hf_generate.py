"""Transformers models patched by tileops against the same model unpatched: compiled and eager
``generate`` and an eager training step, side by side in one run, with the tokens each variant
generated compared to the unpatched model's.

    python -m benchmarks.hf_generate                  # Llama, on a GPU: writes results/hf_generate.{json,md}
    python -m benchmarks.hf_generate --model qwen3    # Qwen3 with the fused attention prologue:
                                                      #   results/hf_generate_qwen3.{json,md}
    python -m benchmarks.hf_generate --quick [--model qwen3]   # small sizes, CPU or GPU: prints the tables

The models (``--model``), random weights from the config, bf16 on CUDA, built in that dtype as
``from_pretrained(dtype=...)`` builds them (the rotary ``inv_freq`` stays fp32):

* ``llama`` (the default): 8 layers, hidden 1024, 16 query / 4 key-value heads (head_dim 64),
  intermediate 2816 (about 8/3 x hidden rounded to 256, Llama's proportion), vocabulary 32000;
* ``qwen3``: Qwen3-0.6B's layer (hidden 1024, 16 query / 8 key-value heads of head_dim 128, so q is
  2048 wide, twice the hidden size; ``q_norm``/``k_norm`` per head; intermediate 3072), 8 layers
  instead of 28 and a vocabulary of 32000 instead of 151936, as the Llama's: a layer holds
  (6 + 9) x 1024 x 1024 weights (q, k, v, o; the MLP), a 151936-wide LM head 148 x 1024 x 1024,
  more than the 8 layers together, which every decode step would read without its being any part of
  what the prologue changes (32000 wide: about 2 layers). Everything else is ``Qwen3Config``'s
  default (no sliding window, so every static-cache layer is a full ``StaticLayer``, which the
  prologue serves).

The variants, copies with the same weights so that all stay compiled side by side
(``tileops.integrations.transformers.patch``):

* ``unpatched``: transformers' own modules;
* ``rope``: ``patch(model, norm=False)``, the RoPE alone;
* ``rope+norm``: ``patch(model, rope=True, norm=True)`` (``patch(model)``), RoPE and the model's
  RMSNorm modules through ``tileops.norm.RMSNormFwdOp`` (the 17 decoder norms; Qwen3's per-head
  q_norm/k_norm too, 16 more);
* ``prologue`` (timed for ``qwen3``; it serves Llama too, one word in :data:`MODELS` away):
  ``patch(model, prologue=True)`` (rope and norm on, as ``patch``'s defaults are): each
  attention's q/k norm, RoPE and static-cache write as one call of
  ``tileops.attention.AttnPrologueFwdOp``. It serves a ``StaticCache`` in inference: its training
  column runs transformers' attention with the rope+norm routing (it warns once saying so), a
  control that should equal rope+norm's.
* ``attention`` (``--attention``, Llama): rope+norm and ``patch(model, attention=True)``, attention
  itself through ``tileops.attention.AttnFwdOp`` (transformers' ``AttentionInterface``) in place of
  HF's ``sdpa`` (what the unpatched model runs). Results go to ``hf_generate[_MODEL]_attention.*``;
* ``prologue+attention`` (``--attention``, Qwen3): ``patch(model, prologue=True, attention=True)``:
  the prologue's variant with the prefill's attention through ``AttnFwdOp`` and each decode step's
  through ``PagedAttnDecodeFwdOp``, over the cache the prologue wrote (one graph a compiled step).

Rows (``--rows`` picks some; each a median of ``--reps`` timings after ``--warmup`` runs, the variants in turn, their order
reversed every other run so that all see the same noise; the ratios are the model's
:attr:`Model.ratios`, e.g. ``prologue / unpatched``):

* compiled generate: ``model.forward = torch.compile(model.forward)`` (Inductor, default mode),
  ``cache_implementation="static"``, greedy, batch 8 x (256 prompt + 128 new tokens), with
  ``disable_compile=True`` so that this is the only compile (HF would otherwise compile
  ``__call__`` again with its own CompileConfig). The graphs each model compiled are counted
  (Dynamo's ``unique_graphs``): before the patch was traceable, the patched model recompiled at
  every decode step until the recompile limit. So are the tileops ops those graphs call, by class
  (the backend is wrapped to read each graph Dynamo hands it): the prologue's fused op has to be
  there, once per layer and graph, or the row timed transformers' attention (a call the prologue
  does not serve falls back silently while Dynamo traces: it cannot warn there). (Inductor fuses
  HF's RMSNorm with its neighbours; a routed norm traced by Dynamo runs the module's own code for
  that reason, so rope+norm's graphs call RoPE's op alone.)
* eager generate: the same generation, nothing compiled, with the model's :attr:`Model.eager_cache`:
  the default dynamic cache for ``llama`` (as measured before), the static cache for ``qwen3`` (the
  only cache the prologue writes; ``disable_compile=True`` keeps HF from compiling it on a GPU);
* eager training step: forward with labels and backward, batch 4 x 2048;
* HF's compiled generate (CUDA only): ``generate(..., cache_implementation="static")`` left to
  compile itself, as transformers does by default for a static cache on a GPU: the prefill runs
  eager, the decode steps through ``torch.compile(model.__call__, mode="reduce-overhead")``
  (Inductor with CUDA graphs, HF's default ``CompileConfig``), so the launches of a step are
  replayed and the row shows the GPU's work more than the host's. (A manual ``torch.compile`` of
  ``forward`` with Inductor's CUDA graphs fails for the unpatched model too: transformers' generate
  keeps each step's outputs, which the next replay overwrites. HF's own compile path serves the
  patched models: on the H200 at ca72b79 every variant ran it, the prologue in 0.88x the unpatched
  time). It runs last, after the
  others are written (each row is written as it completes): a failure inside torch's CUDA graphs
  may take the process down.

Per-run ratios: the median, over the timed runs, of each run's ratio to the run of the other variant
next to it in time (the same repetition), which a drift of the host's load over the whole run
moves less than the ratio of medians does.

A further table gives the process's CPU time over the same runs (``time.process_time``, every
thread; the waits in CUDA synchronisation count too), with the same ratios: a decode step is bound
by the host's launches, and on a shared host the wall time also counts the time the process waited
for a core (the H200 runs of 2026-12-02 saw one variant's five generates spread over 115-202 ms).

Agreement, for each generate row (a second table): the tokens of each variant's last timed run
against the unpatched model's, greedy: the fraction of the 8 x 128 generated tokens equal, the rows
whose 128 tokens are all equal, the first step (1-based) at which any row differs, and the largest
absolute difference of the first step's logits (those that chose token 1: the prefill, the same
prompt for all) from the unpatched model's, beside the unpatched logits' largest magnitude. In
bf16, greedy decoding may diverge at a near-tie and then continues from another prefix, so the
fraction after the first divergence measures little; the step-1 logits difference is the figure to
hold against bf16's rounding (rope+norm's column shows what routing alone moves). In fp32
(``--quick`` on the CPU) every variant must give the unpatched tokens.

Defaults: ``llama`` 10 timed runs after 2 warm-up runs; ``qwen3`` 5 after 1, to keep its run near
150-190 s on an H200: four variants instead of three, and by the Llama run's H200 figures (~1.0 s a
compiled and ~1.8 s an eager generate) 24 compiled and 24 eager generates take ~70 s, Inductor's 8
graphs (2 per model) most of the rest; Llama's defaults would make that ~240 s. One warm-up run
compiles both graphs (prefill and decode); ``--reps``/``--warmup`` override. Measured on the H200
(ca72b79): ``--reps 7``, all four rows, took 229 s; the compiled prologue's lead over unpatched
(5-8%) is within one run's noise on that shared host, so quote a run of 7.

``--quick`` (2 layers, hidden 64, 4 heads of 16, batch 2 x (16 + 8), training 2 x 64, backend
``aot_eager`` on the CPU, fp32) checks that the script runs and that the tokens agree; it writes no
results unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent

#: the generation and the training step (``--quick``: QUICK_RUN)
RUN = dict(batch=8, prompt=256, new=128, train_batch=4, train_seq=2048)
QUICK_RUN = dict(batch=2, prompt=16, new=8, train_batch=2, train_seq=64)
#: ``--quick``'s model, for every ``--model``
QUICK_MODEL = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, vocab=128)

#: the variants: the keyword arguments of ``patch``, None for the unpatched model
VARIANTS: dict[str, dict | None] = {"unpatched": None, "rope": {"rope": True, "norm": False},
                                   "rope+norm": {"rope": True, "norm": True}, "prologue": {"prologue": True},
                                   "attention": {"rope": True, "norm": True, "attention": True},
                                   "prologue+attention": {"prologue": True, "attention": True}}


@dataclass(frozen=True)
class Model:
    """One ``--model``: its transformers classes, full size, variants, ratios and defaults."""

    config: str  #: the transformers config class
    causal_lm: str  #: the transformers ``*ForCausalLM`` class
    size: dict  #: layers, hidden, heads, kv_heads, head_dim, intermediate, vocab
    variants: tuple[str, ...]  #: names in :data:`VARIANTS`, ``unpatched`` first
    ratios: tuple[tuple[str, str], ...]  #: (numerator, denominator) per ratio column
    eager_cache: str  #: the cache of the eager generate row: "dynamic" or "static"
    attention: tuple[str, str]  #: the variant ``--attention`` adds, and the one it differs from by attention alone
    reps: int  #: default timed runs (``--quick``: 2)
    warmup: int  #: default warm-up runs


MODELS = {
    "llama": Model(config="LlamaConfig", causal_lm="LlamaForCausalLM",
                   size=dict(layers=8, hidden=1024, heads=16, kv_heads=4, head_dim=64, intermediate=2816, vocab=32000),
                   variants=("unpatched", "rope", "rope+norm"),
                   ratios=(("rope", "unpatched"), ("rope+norm", "unpatched"), ("rope+norm", "rope")),
                   eager_cache="dynamic", attention=("attention", "rope+norm"), reps=10, warmup=2),
    "qwen3": Model(config="Qwen3Config", causal_lm="Qwen3ForCausalLM",
                   size=dict(layers=8, hidden=1024, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=32000),
                   variants=("unpatched", "rope", "rope+norm", "prologue"),
                   ratios=(("rope+norm", "unpatched"), ("prologue", "unpatched"), ("prologue", "rope+norm")),
                   eager_cache="static", attention=("prologue+attention", "prologue"), reps=5, warmup=1),
}


def model_spec(model: str, attention: bool = False) -> Model:
    """:data:`MODELS` ``[model]``; with ``attention`` (``--attention``), plus the model's attention
    variant (:attr:`Model.attention`) and its ratios to unpatched (HF's ``sdpa``) and to the variant
    it differs from by attention alone: ``attention`` against rope+norm (Llama), ``prologue+attention``
    against prologue (Qwen3: its decode steps read the prologue's cache through
    ``PagedAttnDecodeFwdOp``; its training step runs rope+norm's routing, as prologue's does)."""
    spec = MODELS[model]
    if not attention:
        return spec
    ours, base = spec.attention
    return dataclasses.replace(spec, variants=(*spec.variants, ours),
                               ratios=(*spec.ratios, (ours, "unpatched"), (ours, base)))


def sizes(model: str, quick: bool, attention: bool = False) -> dict:
    """The model's and the run's sizes, in one dict (``--quick --attention``: heads of 64, the
    smallest head_dim the attention op has kernels for)."""
    size = {**(QUICK_MODEL if quick else MODELS[model].size), **(QUICK_RUN if quick else RUN)}
    if quick and attention:
        size["head_dim"] = 64
    return size


def build_models(model: str, size: dict, device: torch.device, dtype: torch.dtype,
                 attention: bool = False) -> dict[str, Any]:
    """One ``model`` per variant of :func:`model_spec`, all with the same random weights, patched as
    :data:`VARIANTS` says."""
    import transformers

    from tileops.integrations.transformers import patch

    spec = model_spec(model, attention)
    cfg = getattr(transformers, spec.config)(
        vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=size["intermediate"],
        num_hidden_layers=size["layers"], num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"],
        head_dim=size["head_dim"], max_position_embeddings=max(4096, size["train_seq"]), pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    models = {}
    for name in spec.variants:
        torch.manual_seed(0)
        # built in dtype as from_pretrained(dtype=...) builds it: the rotary inv_freq stays fp32
        # a config of its own: patch(attention=True) sets the model's attention implementation on its
        # config, which models built from one config object share
        m = getattr(transformers, spec.causal_lm)._from_config(copy.deepcopy(cfg), dtype=dtype).to(device).eval()
        models[name] = m if VARIANTS[name] is None else patch(m, **VARIANTS[name])
    return models


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _side_by_side(calls: dict[str, Callable[[], Any]], device: torch.device, warmup: int,
                  reps: int) -> tuple[dict[str, dict], dict[str, Any]]:
    """Median ms of each call (wall clock, and the process's CPU time: on a shared host the wall
    time of a host-bound generate also counts the time the process waited for a core, which the CPU
    time does not), the calls alternating, and the graphs Dynamo compiled during each; what each call
    returned the last time."""
    graphs = dict.fromkeys(calls, 0)
    times: dict[str, list[float]] = {name: [] for name in calls}
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    last: dict[str, Any] = {}
    for i in range(warmup + reps):
        for name, call in calls.items() if i % 2 == 0 else reversed(list(calls.items())):
            before = _graphs()
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            last[name] = call()
            _sync(device)
            if i >= warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)
                cpu[name].append((time.process_time() - c0) * 1e3)
            graphs[name] += _graphs() - before
    stats = {name: {"ms": statistics.median(ts), "min_ms": min(ts), "max_ms": max(ts), "runs_ms": ts,
                    "cpu_ms": statistics.median(cpu[name]), "graphs_compiled": graphs[name]}
             for name, ts in times.items()}
    return stats, last


class _Recording:
    """A ``torch.compile`` backend: ``backend``'s compiler on every graph Dynamo captures, counting
    the tileops ops the graphs call, by op class (a call's first argument is its op's handle)."""

    def __init__(self, backend: str) -> None:
        self.compile = torch._dynamo.lookup_backend(backend)
        self.ops: Counter[str] = Counter()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        from tileops.runtime.library import layout

        for n in gm.graph.nodes:
            if n.op == "call_function" and str(n.target).startswith("tileops."):
                # a handle Dynamo made a graph input (an int that changed between compiles of one frame:
                # one op a layer, each layer's frame compiled apart after a graph break) names no op here
                h = n.args[0]
                self.ops[layout(h).name if isinstance(h, int) else "(an op whose handle is a graph input)"] += 1
        return self.compile(gm, example_inputs)


def agreement(outs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, dict]:
    """Each variant's generation against ``outs["unpatched"]``; ``outs``: per variant, the
    generated tokens ``[batch, new]`` and the first step's logits ``[batch, vocab]``.

    Per variant other than unpatched: ``tokens_equal`` (the fraction of generated tokens equal to
    the unpatched one's at the same place), ``rows_equal`` of ``rows`` (rows whose tokens are all
    equal), ``first_divergence`` (the first 1-based step at which any row differs; None where none
    does), ``step1_logits_max_abs_diff`` and ``step1_logits_max_abs`` (the unpatched logits' largest
    magnitude, for scale)."""
    want, want_logits = outs["unpatched"]
    scale = float(want_logits.float().abs().max())
    got = {}
    for name, (tokens, logits) in outs.items():
        if name == "unpatched":
            continue
        same = (tokens == want).cpu()
        differs = (~same).any(0).nonzero()
        got[name] = {"tokens_equal": float(same.float().mean()), "rows_equal": int(same.all(1).sum()),
                     "rows": int(same.shape[0]), "first_divergence": int(differs[0]) + 1 if len(differs) else None,
                     "step1_logits_max_abs_diff": float((logits.float() - want_logits.float()).abs().max()),
                     "step1_logits_max_abs": scale}
    return got


def greedy_inputs(size: dict, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, dict[str, Any]]:
    """The prompt (``batch x prompt`` random token ids from ``gen``) and ``generate``'s keywords for a
    greedy generation of exactly ``size["new"]`` tokens."""
    prompt = torch.randint(3, size["vocab"], (size["batch"], size["prompt"]), generator=gen).to(device)
    n = size["new"]
    return prompt, dict(attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        pad_token_id=0)


#: the rows ``--rows`` picks from, in the order they run
ROWS = ("compiled", "eager", "train", "hf-compile")


def run(model: str, size: dict, device: torch.device, backend: str, warmup: int, reps: int,
        which: tuple[str, ...] = ROWS, save: Callable[[list[dict]], None] = lambda rows: None,
        attention: bool = False) -> list[dict]:
    """The rows ``which`` names, in :data:`ROWS`' order; ``save(rows)`` after each row but the last."""
    spec = model_spec(model, attention)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    models = build_models(model, size, device, dtype, attention)
    gen = torch.Generator().manual_seed(1)
    prompt, kwargs = greedy_inputs(size, device, gen)
    n = size["new"]
    # output_logits keeps the float32 copy of each step's logits that HF's greedy loop makes anyway
    kwargs.update(return_dict_in_generate=True, output_logits=True)
    rows = []

    def generate(m, **extra) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            out = m.generate(prompt, **kwargs, **extra)
        return out.sequences[:, prompt.shape[1]:], out.logits[0]

    def each(call: Callable[[Any], Any]) -> dict[str, Callable[[], Any]]:
        return {name: (lambda m=m: call(m)) for name, m in models.items()}

    def timed(setup: str, call: Callable[[Any], Any], compare: bool) -> dict:
        got, outs = _side_by_side(each(call), device, warmup, reps)
        rows.append({"setup": setup, **ratio_row(got, spec.ratios),
                     **({"agreement": agreement(outs)} if compare else {})})
        return rows[-1]

    shape = f"{size['batch']} x ({size['prompt']} + {n})"
    if "compiled" in which:
        torch._dynamo.reset()
        backends = {name: _Recording(backend) for name in models}
        for name, m in models.items():
            m.forward = torch.compile(m.forward, backend=backends[name])
        try:
            with _graphs_for(models):
                row = timed(f"compiled generate ({backend}, static cache), {shape}",
                            lambda m: generate(m, cache_implementation="static", disable_compile=True), True)
            row["ops"] = {name: dict(b.ops) for name, b in backends.items()}
        finally:
            for m in models.values():
                del m.forward
        _refuse_eager(rows)
        save(rows)

    if "eager" in which:
        static = {"cache_implementation": "static", "disable_compile": True} if spec.eager_cache == "static" else {}
        timed(f"eager generate ({spec.eager_cache} cache), {shape}", lambda m: generate(m, **static), True)
        save(rows)

    if "train" in which:
        ids = torch.randint(3, size["vocab"], (size["train_batch"], size["train_seq"]), generator=gen).to(device)

        def train_step(m):
            m.zero_grad(set_to_none=True)
            m(ids, labels=ids).loss.backward()

        for m in models.values():
            m.train()
        timed(f"eager training step (forward + backward), {size['train_batch']} x {size['train_seq']}", train_step,
              False)
        for m in models.values():
            m.eval()
        save(rows)

    # last, after the others are saved: a failure inside torch's CUDA graphs may take the process
    # down (a segfault in Triton's launcher was seen once on the H200 after recompiling with them)
    if "hf-compile" in which and device.type == "cuda":
        torch._dynamo.reset()
        setup = f"HF's compiled generate (prefill eager, decode reduce-overhead), {shape}"
        try:
            with _graphs_for(models):
                timed(setup, lambda m: generate(m, cache_implementation="static"), True)
            _refuse_eager(rows)
        except Exception as e:  # noqa: BLE001 - a row that fails is reported, the others still run
            rows.append({"setup": setup, "error": f"{type(e).__name__}: {e}"[:300]})
    return rows


def _graphs_for(models: dict[str, Any]) -> Any:
    """Room in Dynamo's cache for every variant's graphs. The variants' ``forward`` is one code object
    to Dynamo, which keeps ``recompile_limit`` (8) graphs a code object and runs the calls past them
    eager: the four variants' prefill and decode graphs filled it, and ``--attention``'s fifth variant
    was timed eager in the compiled row (0 graphs compiled; seen on the CPU, 2026-12-07)."""
    return torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, 4 * len(models)))


def _refuse_eager(rows: list[dict]) -> None:
    """The last row, a compiled one, becomes an error row if any variant compiled no graph: its time
    would be an eager run's under a compiled row's name."""
    eager = [name for name, t in rows[-1]["times"].items() if t["graphs_compiled"] == 0]
    if eager:
        rows[-1] = {"setup": rows[-1]["setup"], "error": f"compiled no graph for {', '.join(eager)}: their calls ran "
                                                          f"eager, so the row is not reported"}


def ratio_row(got: dict[str, dict], ratios: tuple[tuple[str, str], ...]) -> dict:
    paired = {f"{a} / {b}": statistics.median(x / y for x, y in zip(got[a]["runs_ms"], got[b]["runs_ms"]))
              for a, b in ratios}
    return {"times": got, "ratios": {f"{a} / {b}": got[a]["ms"] / got[b]["ms"] for a, b in ratios},
            "paired_ratios": paired,
            "cpu_ratios": {f"{a} / {b}": got[a]["cpu_ms"] / got[b]["cpu_ms"] for a, b in ratios}}


def markdown(rows: list[dict], info: dict) -> str:
    spec, s = model_spec(info["model"], info.get("attention", False)), info["size"]
    names = list(spec.variants)
    ratios = [f"{a} / {b}" for a, b in spec.ratios]
    how = ", ".join(f"{n}: patch(model{''.join(f', {k}={v}' for k, v in VARIANTS[n].items())})"
                    for n in names if VARIANTS[n] is not None)
    lines = [f"{spec.causal_lm[: -len('ForCausalLM')]} {s['layers']} layers, hidden {s['hidden']}, "
             f"{s['heads']}/{s['kv_heads']} heads of {s['head_dim']}, intermediate {s['intermediate']}, vocabulary "
             f"{s['vocab']}, {info['dtype']}, random weights; {info['device']}; torch {info['torch']}, transformers "
             f"{info['transformers']}. Medians of {info['reps']} after {info['warmup']} warm-up runs, the variants "
             f"in turn; {how}; a ratio below 1: the first faster.", "",
             f"| setup | {' | '.join(f'{n} ms' for n in names)} | {' | '.join(ratios)} | graphs compiled "
             f"({' / '.join(names)}) |",
             f"|---|{'---:|' * (len(names) + len(ratios) + 1)}"]
    failed = [r for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    for r in rows:
        t = r["times"]
        ms = " | ".join(f"{t[n]['ms']:.1f}" for n in names)
        rs = " | ".join(f"{r['ratios'][k]:.2f}" for k in ratios)
        graphs = " / ".join(str(t[n]["graphs_compiled"]) for n in names)
        lines.append(f"| {r['setup']} | {ms} | {rs} | {graphs} |")
    lines += [f"| {r['setup']} | failed: {r['error']} |" for r in failed]
    lines += ["", "Per-run ratios (the median over the timed runs of each run's ratio to the other variant's run "
                  "of the same repetition):", "", f"| setup | {' | '.join(ratios)} |", f"|---|{'---:|' * len(ratios)}"]
    for r in rows:
        paired = " | ".join(f"{r['paired_ratios'][k]:.2f}" for k in ratios)
        lines.append(f"| {r['setup']} | {paired} |")
    lines += ["", "The process's CPU time over the same runs (medians, ms; `time.process_time`, all threads, the "
                  "waits in CUDA synchronisation included):", "",
              f"| setup | {' | '.join(f'{n}' for n in names)} | {' | '.join(ratios)} |",
              f"|---|{'---:|' * (len(names) + len(ratios))}"]
    for r in rows:
        ms = " | ".join(f"{r['times'][n]['cpu_ms']:.1f}" for n in names)
        rs = " | ".join(f"{r['cpu_ratios'][k]:.2f}" for k in ratios)
        lines.append(f"| {r['setup']} | {ms} | {rs} |")
    for r in rows:
        if "ops" in r:
            calls = "; ".join(f"{n}: {', '.join(f'{k} x {v}' for k, v in sorted(r['ops'][n].items())) or 'none'}"
                              for n in names)
            lines += ["", f"tileops ops in the graphs of {r['setup']} (calls, all graphs together): {calls}."]
    if any("agreement" in r for r in rows):  # (a training row alone compares no tokens)
        lines += ["", f"Tokens against unpatched (greedy, {s['batch']} x {s['new']} new tokens, the last timed run; "
                      f"step 1: the logits after the prefill):", "",
                  "| setup | variant | tokens equal | rows all equal | first differing step | step-1 logits max abs "
                  "diff (unpatched max abs) |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        for name, a in r.get("agreement", {}).items():
            lines.append(f"| {r['setup']} | {name} | {a['tokens_equal']:.3f} | {a['rows_equal']} / {a['rows']} | "
                         f"{a['first_divergence'] or 'none'} | {a['step1_logits_max_abs_diff']:.3g} "
                         f"({a['step1_logits_max_abs']:.3g}) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf_generate")
    p.add_argument("--model", choices=list(MODELS), default="llama", help="the model (default llama)")
    p.add_argument("--quick", action="store_true", help="small sizes (runs on the CPU); writes only with --out")
    p.add_argument("--out", default=None, help="where hf_generate[_MODEL].json/.md go (default benchmarks/results "
                                               "for a full run on a GPU)")
    p.add_argument("--backend", default=None, help="torch.compile backend (default inductor on CUDA, aot_eager on the CPU)")
    p.add_argument("--reps", type=int, default=None, help="timed runs per variant (default llama 10, qwen3 5; "
                                                          "--quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up runs per variant (default llama 2, qwen3 1)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated rows to run, of {', '.join(ROWS)} "
                                                          "(default all; hf-compile runs on CUDA only)")
    p.add_argument("--attention", action="store_true",
                   help="add the variant with attention through tileops (patch(attention=True)); results go to "
                        "hf_generate[_MODEL]_attention.{json,md}")
    args = p.parse_args(argv)
    which = tuple(args.rows.split(","))
    if not which or any(r not in ROWS for r in which):
        p.error(f"--rows: expected a comma-separated subset of {', '.join(ROWS)}, got {args.rows!r}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not args.quick and device.type != "cuda":
        print("the full benchmark needs a CUDA GPU (--quick runs on the CPU)", file=sys.stderr)
        return 2
    import transformers

    spec = model_spec(args.model, args.attention)
    size = sizes(args.model, args.quick, args.attention)
    backend = args.backend or ("inductor" if device.type == "cuda" else "aot_eager")
    reps = args.reps or (2 if args.quick else spec.reps)
    warmup = spec.warmup if args.warmup is None else args.warmup
    info = {"model": args.model, "size": size,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
            "dtype": "bf16" if device.type == "cuda" else "fp32", "torch": torch.__version__,
            "transformers": transformers.__version__, "backend": backend, "reps": reps, "warmup": warmup,
            "rows": list(which), "attention": args.attention}
    out = args.out or (None if args.quick else str(HERE / "results"))
    stem = ("hf_generate" if args.model == "llama" else f"hf_generate_{args.model}") + (
        "_attention" if args.attention else "")

    def save(rows: list[dict]) -> str:
        md = markdown(rows, info)
        if out is not None:  # after each row: a run that dies later keeps what it measured
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / f"{stem}.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
            (Path(out) / f"{stem}.md").write_text(md)
        return md

    print(save(run(args.model, size, device, backend, warmup, reps, which, save, args.attention)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
