"""The op base class: construction checked against the manifest, calls checked against its signature.

Subclasses (one per manifest) define ``__init__`` and ``forward`` with their real signatures and
hand the values to :meth:`Op._setup` and :meth:`Op._call`. Everything a user can get wrong is
checked here, before any kernel runs, and the error names the argument, what was expected and
what came.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Callable, Mapping

import torch

from .runtime import errors, executor, library
from .runtime.binding import with_overlap_checks
from .runtime.cache import Bindings
from .runtime.memory import disjoint, same_view
from .runtime.served import Served, layout_of
from . import manifest as _manifest
from . import schedules
from .autograd import backward_of, grad_needed, run_differentiable
from .manifest import ExprError, OpManifest
from .manifest.call import DTYPE_NAMES, DTYPES, CallSpec
from .manifest.schema import DTYPE_PREFIX, LEAD, ROWS
from .targets import BUILTIN, Target, TargetError, check_target_arg, resolve_target
from .torch_private import internal_overlap

__all__ = ["Op"]

_is_compiling = torch.compiler.is_compiling


class Op:
    """Base of every tileops op: construct once, then call.

    The constructor takes what the kernel is compiled with; the call takes the tensors. Shapes
    and dtypes are taken from the first call (and from each later call with a new dtype, head
    size or device, which compiles once more; new lengths reuse the compiled kernel).
    """

    #: the manifest's op name; defaults to the class name
    op_name: str = ""
    #: the native runtime's ``run`` for this op (None: the Python runtime, :mod:`tileops.runtime.executor`)
    _native_run: Any = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        forward = cls.__dict__.get("forward")
        if forward is not None:  # op(...) runs forward directly: one Python frame (0.6 µs) less per call
            cls.__call__ = forward  # type: ignore[method-assign]

    def _setup(self, params: Mapping[str, Any], target: Any) -> None:
        self.manifest: OpManifest = _manifest.get(self.op_name or type(self).__name__)
        self.name = self.manifest.name
        self.params: dict[str, Any] = self._check_params(dict(params))
        self._target_arg = target
        self._fixed_target: Target | None = check_target_arg(target, self.name)
        self._served_by: str | None = self._fixed_target.name if self._fixed_target else None
        #: the schedule of the last call checked (``schedule``), and one :meth:`tune` imposes on a candidate
        self._schedule: schedules.Schedule | None = None
        self._forced_schedule: tuple | None = None
        #: (call specialization, token bucket, tables' generation) -> the schedule chosen for it
        self._schedules: dict[tuple, schedules.Schedule] = {}
        self._impls: dict[CallSpec, Callable[..., Any]] = {}
        #: what the runtime reads of this op, handed down once (tileops.runtime.served)
        self._layout = layout_of(self.manifest, self.params)
        self._outputs = {o.name: o for o in self._layout.outputs}
        self._like = {o.name: o.like for o in self._layout.outputs}
        #: the inputs the op writes in place (``written``: a KV cache), which a binding's calls check for overlap
        self._written = self._layout.written
        #: outputs whose dtype a param gives (``dtype_by``): name -> that dtype
        self._dtype_by = {o.name: o.dtype for o in self._layout.outputs if o.dtype is not None}
        #: this op's name in the torch.library custom ops (a traced call passes it); the runtime
        #: calls back only these methods, for what only the op can do (tileops.runtime.served.Served)
        self._handle: int = library.register(Served(self._eager_call, self._eager_backward, self._raise_bad_value),
                                             self._layout)
        self._use_runtime(executor.new_runtime(self._handle, self.manifest))

    def _use_runtime(self, runtime: Any) -> None:
        """Serve the calls through ``runtime`` (:mod:`tileops.runtime.executor`; tests and benchmarks
        give an op the Python runtime beside the native one this way)."""
        old = self.__dict__.get("_bindings")
        if old is not None:
            old.clear()
        self._runtime = runtime
        self._native_run = None if isinstance(runtime, executor.PythonRuntime) else runtime.run
        #: every binding of this op's calls and its kernel sets' general paths, the one cache of them
        #: (tileops.runtime.cache): call signature -> (implementation, its Binding or None), see
        #: _eager_call; (kernel set, plan key) -> Binding. The native runtime's index mirrors the first.
        self._bindings = Bindings(mirror=runtime)

    # ----------------------------------------------------------------------------- params
    def _check_params(self, params: dict[str, Any]) -> dict[str, Any]:
        m = self.manifest
        for p in m.params:
            if p.name not in params:
                if not p.has_default:
                    raise TypeError(f"{m.name}: missing required argument {p.name!r}")
                params[p.name] = p.default
            value = params[p.name]
            if value is None:
                if p.optional or p.type == "tensor":
                    continue
                raise TypeError(f"{m.name}: {p.name}: expected {p.type}, got None")
            if p.type == "op":
                self._check_op_param(p.name, value)
                continue
            if p.type == "dtype":
                if isinstance(value, torch.dtype):
                    value = params[p.name] = DTYPE_NAMES.get(value, str(value).replace("torch.", ""))
                if not isinstance(value, str):
                    raise TypeError(f"{m.name}: {p.name}: expected a torch.dtype, got {type(value).__name__} {value!r}")
                if value not in DTYPES:
                    raise ValueError(f"{m.name}: {p.name}: expected a dtype among {', '.join(DTYPES)}, got {value!r}")
            if p.type == "tensor":
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"{m.name}: {p.name}: expected a torch.Tensor or None, "
                                    f"got {type(value).__name__}")
                continue
            if p.type == "ints":
                if not isinstance(value, (list, tuple)) or any(
                        not isinstance(v, int) or isinstance(v, bool) for v in value):
                    raise TypeError(f"{m.name}: {p.name}: expected a list or tuple of ints, got "
                                    f"{type(value).__name__} {value!r}")
                params[p.name] = tuple(value)
                continue
            ok = {
                "dtype": True,  # checked above
                "str": isinstance(value, str),
                "bool": isinstance(value, bool),
                "int": isinstance(value, int) and not isinstance(value, bool),
                "float": isinstance(value, (int, float)) and not isinstance(value, bool),
            }[p.type]
            if not ok:
                raise TypeError(f"{m.name}: {p.name}: expected {p.type}, got {type(value).__name__} {value!r}")
            if p.type == "float":
                value = float(value)
                if not math.isfinite(value):
                    raise ValueError(f"{m.name}: {p.name}: expected a finite number, got {value!r}")
                params[p.name] = value
            if p.choices is not None and value not in p.choices:
                raise ValueError(f"{m.name}: {p.name}: expected one of "
                                 f"{', '.join(repr(c) for c in p.choices)}, got {value!r}")
        for rule in m.rules:
            if not rule.needs_dims:
                self._check_rule(rule, params)
        return params

    def _check_op_param(self, name: str, value: Any) -> None:
        """An ``op`` param: an op object of the family (or the one op) its ``compose`` stage names."""
        m = self.manifest
        stage = next((st for st in m.compose if st.param == name), None)
        want = f"an op of {', '.join(stage.ops)}" if stage is not None else "a tileops op"
        if not isinstance(value, Op):
            raise TypeError(f"{m.name}: {name}: expected {want}, got {type(value).__name__}")
        if stage is not None and value.name not in stage.ops:
            raise TypeError(f"{m.name}: {name}: expected an op of the {stage.family!r} family ({', '.join(stage.ops)}), "
                            f"got {value.name} of the {value.manifest.family!r} family")

    def _check_rule(self, rule: Any, env: Mapping[str, Any]) -> None:
        try:
            ok = rule.check.evaluate(env)
        except ExprError as e:
            raise ValueError(f"{self.manifest.name}: {rule.arg}: {rule.message} (rule `{rule.check}` "
                             f"cannot be checked: {e})") from None
        if not ok:
            got = ", ".join(f"{n}={env[n]!r}" for n in sorted(rule.check.names))
            raise ValueError(f"{self.manifest.name}: {rule.arg}: {rule.message}; got {got}")

    # ----------------------------------------------------------------------------- targets
    @property
    def serving_target(self) -> str | None:
        """The name of the target serving this op: fixed at construction when ``target`` was given,
        else decided by the first call's device (None until then)."""
        return self._served_by

    def _target_for(self, device: torch.device) -> Target:
        if self._fixed_target is not None:
            t = self._fixed_target
            if not t.supports(self.name, self.manifest.family, device):
                raise TargetError(f"{self.name}: target: {t.name!r} cannot serve {device.type} tensors")
            return t
        t, _ = resolve_target(self.name, self.manifest.family, device)
        if not t.supports(self.name, self.manifest.family, device):
            first = self.manifest.inputs[0].name
            raise TargetError(f"{self.name}: {first}: no registered target serves {device.type} tensors "
                             f"(BUILTIN runs on cuda and cpu; pass target='torch' for plain PyTorch)")
        self._served_by = t.name
        return t

    # ----------------------------------------------------------------------------- calls
    def _call(self, tensors: Mapping[str, Any], outs: Mapping[str, Any] | None = None,
              flags: Mapping[str, bool] | None = None) -> Any:
        """Run the op: eagerly, or as a ``torch.library`` custom op while ``torch.compile`` traces.

        An eager call goes to the native runtime first (:mod:`tileops.runtime.native`), which serves a
        call whose signature was bound before and returns ``NotImplemented`` for any other. A call that
        sets one of the manifest's ``flags`` goes to the family's :meth:`_flagged_call`."""
        if flags and any(flags.values()):
            return self._flagged_call(tensors, outs or {}, flags)
        if _is_compiling():
            return self._traced_call(tensors, outs or {})
        run = self._native_run
        if run is not None:
            result = run(tensors, outs)
            if result is not NotImplemented:
                return result
        return self._eager_call(tensors, outs)

    def _flagged_call(self, tensors: Mapping[str, Any], outs: Mapping[str, Any], flags: Mapping[str, bool]) -> Any:
        """A call that sets a flag of the manifest's ``flags``: the family's hooks serve it (a family
        that declares flags overrides this)."""
        raise NotImplementedError(f"{self.name}: {', '.join(n for n, v in flags.items() if v)}: no hook serves it")

    def _traced_call(self, tensors: Mapping[str, Any], outs: Mapping[str, Any]) -> Any:
        """The call as one of :mod:`tileops.runtime.library`'s custom ops: inputs and outputs as lists in the
        manifest's order. With any output given, every output the call produces is passed to
        ``apply_out`` (those not given as new tensors), so the result is what the eager call returns; so
        are the inputs the op writes in place (a KV cache), after the outputs, as ``apply_out``'s mutated
        tensors rather than among its inputs."""
        made = self._layout.produced(tensors)
        for o in self.manifest.outputs:
            if outs.get(o.name) is not None and tensors.get(o.like) is None:
                raise ValueError(f"{self.name}: {o.name}: given without {o.like}, whose result it would hold")
        grad_needed(self, tensors, {k: v for k, v in outs.items() if v is not None})  # raises as the eager call does
        written = library.written(self._layout, tensors)
        inputs, names = library.pack(self._layout, {k: v for k, v in tensors.items() if k not in written})
        if written or any(outs.get(o.name) is not None for o in made):
            got = [outs[o.name] if outs.get(o.name) is not None else self._layout.new_output(o, tensors) for o in made]
            torch.ops.tileops.apply_out(self._handle, inputs, names, got + [tensors[n] for n in written])
        else:
            got = torch.ops.tileops.apply(self._handle, inputs, names)
        return got[0] if len(made) == 1 else tuple(got)

    def _output_dtype(self, name: str, tensors: Mapping[str, Any]) -> torch.dtype:
        """The dtype of output ``name`` of a call with ``tensors``: its ``dtype_by`` param's, else its like input's."""
        return self._dtype_by.get(name) or tensors[self._like[name]].dtype

    def _new_output(self, name: str, tensors: Mapping[str, Any], zeros: bool = False) -> torch.Tensor:
        """A new tensor for output ``name`` of a call with ``tensors``, as the runtime makes one
        (:meth:`tileops.runtime.served.Layout.new_output`)."""
        return self._layout.new_output(self._outputs[name], tensors, zeros)

    def _eager_backward(self, grads: tuple, tensors: Mapping[str, Any]) -> tuple:
        """The gradients of the inputs ``backward.wrt`` names (those given), from the outputs'."""
        return backward_of(self, self._impl_for(self._check_call(tensors)), grads, tensors)

    def _impl_for(self, spec: CallSpec) -> Any:
        """The serving target's implementation of one call specialization, made once."""
        impl = self._impls.get(spec)
        if impl is None:
            impl = self._impls[spec] = self._target_for(spec.device).implement(self, spec)
        return impl

    # ----------------------------------------------------------------------------- errors
    def _raise_bad_value(self, name: str, values: "torch.Tensor | None", when: str = "",
                         found: "errors.BadValue | None" = None) -> None:
        """Raise the ValueError of a call whose kernel found a value of input ``name`` out of range
        (the runtime's tracker calls this, :class:`tileops.runtime.served.Served`'s ``raise_bad_value``; ``values``
        is None when the tensor was freed before the report, ``found`` the kernel's record of the
        first bad element, if any). A family whose kernels check values words its own error in its
        hooks (RoPE's names the position and its range); this default, for a family that does not,
        names the op, the input, the first bad element where known, and the call."""
        at = f" ({name}{found})" if found is not None else ""
        raise ValueError(f"{self.name}: {name or 'an input'}: a value is out of range{at} ({when or 'this call'})")

    def check(self) -> None:
        """Wait for this thread's calls of this op and raise the ValueError of the first bad value
        among them (each bad call is reported once: call again for the next); also judges the calls
        captured in CUDA graphs (synchronise after a replay first), and clears their error words for
        the next replay. Returns None when every value was valid."""
        self._runtime.check()

    def compile(self, *, dtypes: "tuple[str, ...] | list[str] | None" = None, device: "str | torch.device | None" = None,
                with_inputs: "tuple[str, ...] | list[str] | None" = None, backward: bool = True,
                jobs: int | None = None, progress: bool | None = None, **dims: int) -> int:
        """Compile ahead of time, without data, the kernels this op's calls will need, several at
        once in separate processes (``jobs``, default one per CPU), into the disk cache, so that a
        server's first calls load them (no compile, and no TileLang import, in a new process).

        Args:
            dtypes: The dtypes of ``x`` the calls will use (names such as ``"bfloat16"``); default all
                the manifest allows.
            device: The device the calls will run on (its arch is compiled for); default ``cuda`` when
                a GPU is present, else ``cpu``.
            with_inputs: The optional inputs the calls will pass, e.g. ``("position_ids", "key")``;
                default every combination. Integer inputs (positions) are compiled for each of their dtypes.
            backward: Also the backward kernels (default True).
            jobs: Processes compiling at once; 1 compiles in this process. The processes run
                ``python -m tileops.compile.warmup``, not the calling script: no ``__main__`` guard is needed.
            progress: One step per kernel on stderr (a tqdm bar on a terminal): True shows it, False
                hides it; None (default) shows it when stderr is a terminal, unless
                ``TILEOPS_PROGRESS=0`` (:mod:`tileops.progress`).
            **dims: The dims kernels are compiled for (for RoPE: ``head_dim``); other dims are dynamic.

        Returns:
            The number of kernels now in the cache (0 when the serving target compiles nothing).

        Raises:
            TypeError: A dim the manifest compiles for is missing or not an int, or an unknown dim
                is given.
            ValueError: A dim below 1 or one a call would be refused for (the manifest's rules,
                e.g. an odd ``head_dim``), a dtype the op does not take, an unknown optional input, or a failed
                compile.
        """
        from .compile.build import device_backend
        from .compile.warmup import compile_jobs, op_kernel_jobs

        m = self.manifest
        want = set(m.kernel.specialize)
        if set(dims) != want:
            missing, extra = sorted(want - set(dims)), sorted(set(dims) - want)
            raise TypeError(f"{m.name}.compile: expected the dims {', '.join(sorted(want))}"
                            + (f"; missing {', '.join(missing)}" if missing else "")
                            + (f"; unknown {', '.join(extra)}" if extra else ""))
        for name, size in dims.items():
            if isinstance(size, bool) or not isinstance(size, int):
                raise TypeError(f"{m.name}.compile: {name}: expected an int, got {type(size).__name__} {size!r}")
            if size < 1:
                raise ValueError(f"{m.name}.compile: {name}: expected a positive size, got {size}")
        self._check_dim_rules(dims)  # what a call with these dims would be refused for
        allowed = m.inputs[0].dtypes
        dtypes = tuple(dtypes) if dtypes is not None else tuple(allowed)
        bad = [d for d in dtypes if d not in allowed]
        if bad:
            raise ValueError(f"{m.name}.compile: dtypes: expected some of {', '.join(allowed)}, got {bad[0]!r}")
        optional = [t.name for t in m.inputs if t.optional]
        if with_inputs is not None:
            unknown = [n for n in with_inputs if n not in optional]
            if unknown:
                raise ValueError(f"{m.name}.compile: with_inputs: expected some of {', '.join(optional) or '(none)'}, "
                                 f"got {unknown[0]!r}")
        dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if self._target_for(dev).name != BUILTIN:
            return 0  # another target serves this device: nothing of tileops' to compile
        _, arch = device_backend(dev)
        todo = op_kernel_jobs(self.name, self.params, dims, dtypes, arch, with_inputs=with_inputs,
                              every_index_dtype=True, backward=backward)
        n, _, failures = compile_jobs(todo, jobs, progress)
        if failures:
            raise ValueError(f"{m.name}.compile: {len(failures)} of {n} kernels failed; first: {failures[0][1]}")
        return n

    def _eager_call(self, tensors: Mapping[str, Any], outs: Mapping[str, Any] | None = None) -> Any:
        """Check ``tensors`` against the signature, then run the serving implementation.

        ``tensors`` maps every input name to its tensor, or to None for an optional input not
        given; ``outs`` maps output names to tensors to write into (``out=``), or None. Returns the
        output, or a tuple of the outputs whose ``like`` input was given.

        The checks depend only on each argument's shape, strides, dtype and device and on which
        outputs are given (and which are their input itself, in place): a call whose *signature*
        was seen before skips them, and runs the implementation's :class:`tileops.runtime.binding.Binding`
        for it, when it has one (its ``binding(tensors, outs)``), which checks only what pointers
        decide. The runtime keeps the binding too, and serves the next such call without Python.
        """
        outs = outs or {}
        try:
            sig = self._signature(tensors, outs)
            entry = self._bindings.get(sig)
        except (AttributeError, TypeError):  # not a tensor: the full check names the argument
            sig, entry = None, None
        rt = self._runtime
        checked = entry is None
        if entry is None:
            spec = self._check_call(tensors)
            given = {k: v for k, v in outs.items() if v is not None}
            if given:  # before the implementation is made, which may compile a kernel for seconds
                self._check_outs(tensors, given)
            impl = self._impl_for(spec)
            make = getattr(impl, "binding", None) if sig is not None else None
            b = make(tensors, given) if make is not None else None
            if b is not None and self._dtype_by and any(
                    outs.get(n) is None and tensors.get(self._like[n]) is not None
                    and self._output_dtype(n, tensors) != tensors[self._like[n]].dtype for n in self._dtype_by):
                b = None  # the runtime makes a new output like its like input, in that input's dtype
            entry = (impl, with_overlap_checks(b, tensors, given, self._written) if b is not None else None)
            if sig is not None:
                self._bindings.put(sig, entry)
        if self._native_run is not None:  # (the Python runtime keeps no bindings, and defers nothing)
            if sig is not None:
                rt.add(tensors, outs, entry[1])  # the next such call is served without Python
            if rt.has_pending():
                rt.reap()  # an earlier call's bad value, found without waiting (raised before this call runs)
        impl, b = entry
        if b is not None and not (torch.is_grad_enabled() and self._needs_grad(tensors)):
            result = rt.execute(b, tensors, outs)
            if result is not NotImplemented:
                return result
            checked = False  # pointers the binding cannot serve: check this call in full
        given = {k: v for k, v in outs.items() if v is not None}
        if not checked:  # what the pointers decide: the binding refused the call, or there is none
            self._check_written(tensors)
            if given:
                self._check_outs(tensors, given)
        return run_differentiable(self, impl, tensors, given)

    def run_plan(self, owner: Any, key: tuple | None, make: Callable[[], Any], tensors: Mapping[str, Any],
                 outs: Mapping[str, Any], scalars: tuple[int, ...] = ()) -> Any:
        """Run a kernel set's plan on this op's runtime: the binding ``owner`` keeps under ``key`` in the
        op's one cache (:class:`tileops.runtime.cache.Bindings`), made by ``make`` at the key's first call;
        ``key=None`` binds this call alone (an address only it holds). The kernel sets' one door to the
        runtime, so that none of them reaches the op's cache or executor. Returns what the plan returns,
        or NotImplemented where ``make`` gave None (such calls cannot be bound) or this call's pointers
        miss the binding's alignment or overlap (the caller then fits a copy)."""
        b = make() if key is None else self._bindings.bind(owner, key, make)
        if b is None:
            return NotImplemented
        return self._runtime.execute(b, tensors, outs, scalars)

    def _forget_bindings(self) -> None:
        """Drop every binding (the op's and its runtime's); the next call of each signature binds again."""
        self._bindings.clear()

    @staticmethod
    def _needs_grad(tensors: Mapping[str, Any]) -> bool:
        for t in tensors.values():
            if t is not None and t.requires_grad:
                return True
        return False

    def _signature(self, tensors: Mapping[str, Any], outs: Mapping[str, Any]) -> tuple:
        """What the checks of a call depend on (see :meth:`_eager_call`); raises AttributeError
        for an argument that is not a tensor."""
        sig: list[Any] = [None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in tensors.values()]
        for name, o in outs.items():
            if o is None:
                sig.append(None)
            elif o is tensors.get(self._like[name]):
                sig.append(True)  # in place
            else:
                sig.append((o.shape, o.stride(), o.dtype, o.device))
        return tuple(sig)

    def _check_outs(self, tensors: Mapping[str, Any], outs: Mapping[str, Any]) -> None:
        """``out=``-style tensors: each like its input (shape, dtype, device), and overlapping no
        input or other output, except that an output may be its own input exactly (in place)."""
        m = self.manifest
        for spec in m.outputs:
            o = outs.get(spec.name)
            if o is None:
                continue
            src = tensors.get(spec.like)
            if not isinstance(o, torch.Tensor):
                raise TypeError(f"{m.name}: {spec.name}: expected a torch.Tensor or None, got {type(o).__name__}")
            if src is None:
                raise ValueError(f"{m.name}: {spec.name}: given without {spec.like}, whose result it would hold")
            # a wrong dtype is a TypeError and a wrong shape or device a ValueError, as for an input
            dtype = self._output_dtype(spec.name, tensors)
            shape = self._layout.shape_of(self._outputs[spec.name], tensors)
            for what, want, got, error in (("shape", shape or list(src.shape), list(o.shape), ValueError),
                                           ("dtype", dtype, o.dtype, TypeError),
                                           ("device", src.device, o.device, ValueError)):
                if want != got:
                    by = (f"{spec.dtype_by}={self.params[spec.dtype_by]!r}" if what == "dtype" and
                          spec.name in self._dtype_by else
                          "[" + ", ".join(spec.own_shape) + "]" if what == "shape" and shape else spec.like)
                    raise error(f"{m.name}: {spec.name}: expected {what} {want} (that of {by}), got {got}")
            if internal_overlap(o) == 1:  # as torch refuses an in-place write into one
                raise ValueError(f"{m.name}: {spec.name}: expected a tensor whose elements each have their own "
                                 f"memory, got one whose elements share memory (strides {list(o.stride())}, e.g. "
                                 f"an expanded view)")
            others = [(n, t) for n, t in tensors.items() if isinstance(t, torch.Tensor)]
            others += [(n, t) for n, t in outs.items() if n != spec.name and isinstance(t, torch.Tensor)]
            for name, t in others:
                if name == spec.like and same_view(o, t):
                    continue  # in place
                if not disjoint(o, t):
                    raise ValueError(f"{m.name}: {spec.name}: overlaps {name} in memory; an output may be its "
                                     f"own input exactly (in place) or memory no other argument uses")

    def _check_call(self, tensors: Mapping[str, Any]) -> CallSpec:
        m = self.manifest
        dims: dict[str, int] = {}
        dtypes: list[tuple[str, str]] = []
        device: torch.device | None = None
        first = None
        rows: int | None = None  # the first leading input's rows (schedules.ROWS), for the token bucket
        for spec in m.inputs:
            t = tensors.get(spec.name)
            if t is None and spec.optional:
                continue
            if not isinstance(t, torch.Tensor):
                none = " or None" if spec.optional else ""
                raise TypeError(f"{m.name}: {spec.name}: expected a torch.Tensor{none}, got {type(t).__name__}")
            dname = DTYPE_NAMES.get(t.dtype, str(t.dtype).replace("torch.", ""))
            if dname not in spec.dtypes:
                raise TypeError(f"{m.name}: {spec.name}: expected dtype {', '.join(spec.dtypes)}, got {dname}")
            dtypes.append((spec.name, dname))
            shapes = spec.shapes_for(self.params)
            shape = next((s for s in shapes if len(s) == t.dim() or (s[:1] == (LEAD,) and t.dim() >= len(s) - 1)),
                         None)
            if shape is None:
                by = f" for {spec.shape_by}={self.params[spec.shape_by]!r}" if spec.shape_by else ""
                want = " or ".join(f"{len(s) - 1} or more dims [{', '.join(s)}]" if s[:1] == (LEAD,)
                                   else f"{len(s)} dims [{', '.join(s)}]" for s in shapes)
                raise ValueError(f"{m.name}: {spec.name}: expected {want}{by}, "
                                 f"got {t.dim()} dims {list(t.shape)}")
            if device is None:
                device, first = t.device, spec.name
            elif t.device != device:
                raise ValueError(f"{m.name}: {spec.name}: expected a tensor on {device} (the device of "
                                 f"{first}), got one on {t.device}")
            src = tensors.get(spec.like) if spec.like is not None else None
            if src is not None:  # exactly like an earlier input: its shape (leading dims too) and dtype
                if t.dtype != src.dtype:
                    raise TypeError(f"{m.name}: {spec.name}: expected dtype {DTYPE_NAMES[src.dtype]} (that of "
                                    f"{spec.like}), got {dname}")
                if t.shape != src.shape:
                    raise ValueError(f"{m.name}: {spec.name}: expected shape {list(src.shape)} (that of "
                                     f"{spec.like}), got {list(t.shape)}")
            named = shape[1:] if shape[:1] == (LEAD,) else shape
            if shape[:1] == (LEAD,) and rows is None:
                rows = math.prod(t.shape[: t.dim() - len(named)])
            for dim, size in zip(named, t.shape[t.dim() - len(named):]):
                if dim in dims and dims[dim] != size:
                    raise ValueError(f"{m.name}: {spec.name}: expected {dim}={dims[dim]} (as in {first}), "
                                     f"got {dim}={size} in shape {list(t.shape)}")
                dims[dim] = int(size)
        self._check_dim_rules(dims, {DTYPE_PREFIX + t.name: None for t in m.inputs}
                              | {DTYPE_PREFIX + n: d for n, d in dtypes})
        assert device is not None
        self._check_written(tensors)
        self._check_more(tensors, dims)
        # only the dims kernels are compiled for: other sizes share one implementation
        static = sorted((d, dims[d]) for d in m.kernel.specialize)
        call = CallSpec(device=device, dtypes=tuple(dtypes), dims=tuple(static))
        chosen = self._schedule_for(call, dims if rows is None else {**dims, ROWS: rows})
        self._schedule = chosen
        return dataclasses.replace(call, schedule=chosen.knobs) if chosen.knobs else call

    def _schedule_for(self, call: CallSpec, dims: Mapping[str, int]) -> schedules.Schedule:
        """The schedule serving a call (:mod:`tileops.schedules`): a candidate being tuned
        (:meth:`tune`), else for ``target=None`` served by BUILTIN the tuned or shipped choice for the
        call's shape class, else the built-in one (``target=BUILTIN``; another target has its own)."""
        # kept per class: a backward checks its call again every step (the choice costs 8-70 us on 2 cores)
        # (every bucket: 16 x 1,024 and 1 x 16,384 share a token bucket and CallSpec, not a class)
        key = (call, schedules.buckets(self.manifest, dims), schedules.generation())
        got = self._schedules.get(key)
        if got is not None:
            return got
        forced = self._forced_schedule
        if forced is not None:
            got = schedules.Schedule(knobs=forced, source="a candidate being tuned",
                                     shape_class=schedules.shape_class(self.manifest, call, dims, self.params))
        elif self._fixed_target is None and self._target_for(call.device).name == BUILTIN:
            got = schedules.choose(self.manifest, call, dims, self.params)
        elif self._fixed_target is not None and self._fixed_target.name != BUILTIN:
            got = schedules.Schedule(source=f"target {self._fixed_target.name!r}'s own")
        else:
            got = schedules.Schedule(shape_class=schedules.shape_class(self.manifest, call, dims, self.params))
        if len(self._schedules) > 4096:  # many classes (new head dims, dtypes): keep the table bounded
            self._schedules.clear()
        self._schedules[key] = got
        return got

    @property
    def schedule(self) -> schedules.Schedule | None:
        """The schedule chosen for the last call this op checked (the first call of each new shape,
        dtype or layout; later calls of one signature reuse it): its knobs over the manifest's
        ``kernel.static``, where it came from (``built-in``, ``shipped for NVIDIA H200``, ``tuned on
        this machine at ...``) and its shape class. None before the first call."""
        return self._schedule

    def tune(self, *args: Any, budget: float | None = None, progress: bool | None = None,
             **kwargs: Any) -> schedules.Schedule:
        """Tune this op's schedule for calls like ``self(*args, **kwargs)``, on their device: every
        candidate of the manifest's space (``kernel.tune``) is built, checked against the family's
        float64 reference (dropped and reported when wrong, or when it fails to build) and timed beside
        the built-in schedule; the fastest is kept in this machine's table for the call's shape class
        (the built-in one unless a candidate is faster by more than the timing's noise), and serves this
        op and every later one built with ``target=None`` (:mod:`tileops.schedules`).

        Args:
            budget: Seconds to spend at most (default: the whole space); the best so far is kept.
            progress: A line per candidate on stderr (None: when stderr is a terminal).

        Returns:
            The schedule now chosen for the call's shape class.

        Raises:
            ValueError: The manifest declares no schedule space for the device's backend, or the op is
                served by a target other than BUILTIN.
        """
        from . import tuning

        bound = inspect.signature(self.forward).bind(*args, **kwargs)
        names = {t.name for t in self.manifest.inputs}
        inputs = {k: v for k, v in bound.arguments.items() if k in names}
        return tuning.tune(self, inputs, budget=budget, progress=progress)

    def _check_written(self, tensors: Mapping[str, Any]) -> None:
        """Inputs the op writes in place (``written``): each element its own memory, and no memory
        shared with any other input (a cache overlapping qkv or the other cache would be read after
        it was written)."""
        m = self.manifest
        for spec in m.inputs:
            t = tensors.get(spec.name)
            if not spec.written or t is None:
                continue
            if internal_overlap(t) == 1:
                raise ValueError(f"{m.name}: {spec.name}: expected a tensor whose elements each have their own memory "
                                 f"(it is written), got one whose elements share memory (strides {list(t.stride())})")
            for other in m.inputs:
                u = tensors.get(other.name)
                if other.name != spec.name and u is not None and not disjoint(t, u):
                    raise ValueError(f"{m.name}: {spec.name}: overlaps {other.name} in memory; an input the op "
                                     f"writes may share memory with no other argument")

    def _check_dim_rules(self, dims: Mapping[str, int], dtypes: Mapping[str, str | None] | None = None) -> None:
        """The manifest's rules checked at the call (over dims, or inputs' dtypes ``dtype_<input>``)
        whose every name ``dims``, ``dtypes`` and the params give."""
        env = {**self.params, **dims, **(dtypes or {})}
        for rule in self.manifest.rules:
            if rule.needs_dims and rule.check.names <= env.keys():
                self._check_rule(rule, env)

    def _check_more(self, tensors: Mapping[str, Any], dims: Mapping[str, int]) -> None:
        """Op-specific checks that the rule language does not express (default: none)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - subclasses define it
        raise NotImplementedError

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={_short(v)}" for k, v in self.params.items())
        return f"{self.name}({shown}, target={self._target_arg!r})"


def _short(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor(shape={list(v.shape)}, dtype={v.dtype})"
    return repr(v)


