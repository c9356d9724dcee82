"""Where the tensors of a probed pass were made: the user's line of the op that returned each.

A finding's evidence is often read on one line and caused on another: a mask built in the
model's forward (or a `tril` buffer registered in `__init__`) and filled into the scores in a
helper, heads split in one method and multiplied in another, a residual added in a module the
probe reads as a block output. `Origins` is a TorchFunctionMode made for a recording with a
Trace (`generic._installed`: probed passes only, the unprobed steps never enter it,
tests/capture/test_origins.py) and on while the model's own forward runs (its root module's
hooks); it notes, for every tensor an op returns, the innermost frame of the user's code
(source.py's rule) and the tensors it was made from.
The recording then asks, at the ops the probes read:

* `line(t)`: the line that made `t` (a module's output, q at the score product, the softmax's
  input);
* `mask_origin(mask, call)`: the line that built the mask the scores were filled with, followed
  back through the ops inside the attention call (`~mask`, `mask == 0`, a slice) to the tensor
  made outside it, or to the `register_buffer` / `self.x =` line of a buffer;
* `none_passed()`: for an attention that got no mask, the call that passed `None` for it.

Only weak references and ids are held; the notes die with the recording.

`TakenLines` answers one more question, in a probe's own forward (the residual test's): where
the user's code takes a module's output (the frame a residual lost around an attention was
lost in).
"""
from __future__ import annotations

import ast
import inspect
import linecache
import os
import re
import sys
import textwrap
import weakref

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from tndebug.capture.source import file_kind, location

_HERE = os.path.dirname(os.path.realpath(__file__)) + os.sep
_TNDEBUG = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep
_PATCHING = _HERE + "patching.py"
_SKIP, _OURS, _WRAP = "skip", "ours", "wrap"      # a frame's kind (`_file_kind`)
_FILES: dict[str, object] = {}


def _file_kind(filename: str):
    """_OURS (tndebug's code), _WRAP (a recording wrapper: called on the user's behalf),
    "user" or a package name (source.file_kind), or _SKIP (torch, the standard library)."""
    k = _FILES.get(filename)
    if k is None:
        path = os.path.realpath(filename) if filename and not filename.startswith("<") else ""
        if path == _PATCHING:
            k = _WRAP
        elif path.startswith(_TNDEBUG):
            k = _OURS
        else:
            k = file_kind(filename) or _SKIP
        _FILES[filename] = k
    return k


def _user_frame(frame):
    """The innermost frame of the user's (or transformers') code above `frame`, or None when
    the op was tndebug's own work (a hook, a statistic) or tndebug's model's."""
    while frame is not None:
        k = _file_kind(frame.f_code.co_filename)
        if k == _OURS:
            return None
        if k not in (_SKIP, _WRAP):
            return frame
        frame = frame.f_back
    return None


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


class Origins(TorchFunctionMode):
    """The notes of one recording: id(tensor) -> (weak ref, (file, line, function, kind), id of
    the attention call it was made in (0: none), parents). A parent is (weak ref, its own note
    as it was then or None, numel): temporaries (`self.tril[:T, :T]` before `== 0`) are freed
    long before a probe asks, their notes are not."""

    def __init__(self, state) -> None:
        super().__init__()
        self.state = state
        self.made: dict[int, tuple] = {}
        self.active = False

    def open(self) -> None:
        """Note from here on (the model's forward begins: a module hook, outside any op)."""
        if not self.active:
            self.__enter__()
            self.active = True

    def close(self) -> None:
        """Stop noting: the mode leaves torch's stack, if it is on top of it (a hook runs
        outside any op); the notes stay readable."""
        if self.active and _get_current_function_mode_stack()[-1:] == [self]:
            self.__exit__(None, None, None)
            self.active = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _FILES.get(sys._getframe(1).f_code.co_filename) == _OURS:
            return out                            # tndebug's own statistics: nothing to note
        try:
            self._note(out, args, kwargs, getattr(func, "__name__", ""))
        except Exception:       # noqa: BLE001 - the notes never break the user's forward
            pass
        return out

    def _note(self, out, args, kwargs, name: str = "") -> None:
        if isinstance(out, torch.Tensor):
            outs = (out,)
        elif isinstance(out, (tuple, list)):
            outs = tuple(o for o in out if isinstance(o, torch.Tensor))
            if not outs:
                return
        else:
            return
        frame = _user_frame(sys._getframe(2))
        if frame is None:
            return
        code = frame.f_code
        where = (code.co_filename, frame.f_lineno, getattr(code, "co_qualname", code.co_name),
                 _file_kind(code.co_filename))
        parents = tuple(_tensors(args, kwargs))
        calls = self.state.calls
        cid = id(calls[-1]) if calls else 0
        made = self.made
        refs = tuple((weakref.ref(p), made.get(id(p)), p.numel()) for p in parents)
        for o in outs:
            if any(o is p for p in parents):       # in place: the tensor was made before
                continue
            made[id(o)] = (weakref.ref(o), where, cid, refs, name)

    # -- questions -------------------------------------------------------------------------
    def entry(self, t) -> tuple | None:
        e = self.made.get(id(t)) if isinstance(t, torch.Tensor) else None
        return e if e is not None and e[0]() is t else None

    def line(self, t) -> dict | None:
        """The user's line that made `t`, as a location (source.location)."""
        e = self.entry(t)
        return _loc(e[1]) if e is not None else None

    def mask_origin(self, mask, call) -> dict | None:
        """Where the mask applied in `call` was built: `mask` followed back through the ops made
        inside that call to the first tensor made outside it (the model's forward, a mask
        helper), or to the line that assigned the buffer or attribute it was read from. An op on
        the way that moves the mask's entries (a transpose, a flip, a tril: `GEOMETRIC`) is where
        the mask became what it is: its line."""
        cid = id(call)
        e = self.entry(mask)
        if e is None:
            return attribute_line(self.state.cap.model, mask)
        for _ in range(32):
            if e[2] != cid:
                return _loc(e[1])
            if not e[3] or e[4] in GEOMETRIC:
                return _loc(e[1])                 # built (or rearranged) inside the attention
            ref, note, _ = min(e[3], key=lambda p: p[2])   # a mask broadcasts: the smaller operand
            if note is None or note[0]() is not None and note[0]() is not ref():
                return attribute_line(self.state.cap.model, ref()) or _loc(e[1])
            e = note
        return None

    def none_passed(self) -> dict | None:
        """For an attention that applied no mask: the call that passed `None` for one. From the
        innermost user frame outwards, while a function's own parameter named like a mask
        (`mask`, `attn_mask`, `attention_mask`: a hint for the line, not a verdict) is None, the
        next user frame out is its caller; the line there passed it (`layer(h, freqs, None)`).
        None when the innermost frame takes no such parameter."""
        frame = sys._getframe(1)
        while frame is not None and _file_kind(frame.f_code.co_filename) in (_OURS, _WRAP):
            frame = frame.f_back                  # the recording's own frames
        frame = _user_frame(frame)
        found = None
        while frame is not None:
            code = frame.f_code
            n = code.co_argcount + code.co_kwonlyargcount
            names = [v for v in code.co_varnames[:n] if "mask" in v.lower()]
            if not names or any(frame.f_locals.get(v, 0) is not None for v in names):
                break
            found = frame
            frame = _user_frame(frame.f_back)
        if found is None or frame is None:
            return None
        code = frame.f_code
        return location(code.co_filename, frame.f_lineno, getattr(code, "co_qualname", code.co_name),
                        _file_kind(code.co_filename))


# ops that move a mask's entries to other positions (not a slice, a comparison, a negation)
GEOMETRIC = frozenset({"transpose", "transpose_", "permute", "flip", "fliplr", "flipud", "roll",
                       "rot90", "swapaxes", "swapdims", "movedim", "moveaxis", "tril", "triu", "t"})


def _loc(where) -> dict | None:
    if where is None:
        return None
    file, line, function, kind = where
    return location(file, line, function, kind)


def attribute_line(model, t) -> dict | None:
    """The line that assigned the buffer (or tensor attribute) `t` of a module of `model`:
    `self.register_buffer("tril", ...)` or `self.tril = ...` in the module's class (its own
    code or a base's), as a location; None when `t` is no module's or no such line is found."""
    if model is None or not isinstance(t, torch.Tensor):
        return None
    for module in model.modules():
        for attr, v in (*module._buffers.items(), *vars(module).items()):
            if v is t:
                return _assignment(type(module), attr)
    return None


def constructor_line(model, path: str) -> dict | None:
    """The line that made the submodule at `path` (`self.ln_1 = nn.LayerNorm(d, eps=1e-12)`: a
    norm's eps, a dropout's rate are set there), in the class of the module that holds it; a
    layer of a list: the line that made the list. None when not found."""
    if model is None or not path:
        return None
    parts = path.split(".")
    while parts and parts[-1].isdigit():
        parts.pop()
    if not parts:
        return None
    try:
        owner = model.get_submodule(".".join(parts[:-1]))
    except AttributeError:
        return None
    return _assignment(type(owner), parts[-1])


def table_line(model, rows) -> dict | None:
    """Where a position table made in `__init__` (outside every probed forward) was built:
    `rows` [L, d] is its part of the embedding (one token at every position); the model's
    buffer or tensor attribute whose first L rows, centred, are `rows` centred up to a scale
    (the table itself, found by its values) is followed to the line that assigned it, and from
    there into the function that line calls to make it (`self.table(d, L)`, resolved on the
    module's own class; `sinusoids(L, d)`, a function of its file): the statement there that
    holds the table's base (a number >= 100: 10000 in the paper, a rotary theta), where the
    frequencies are set. Found by reading the source, and marked so (`"read": True`); the
    assignment's line when that function is not found; None when no tensor of the model
    matches."""
    if model is None or not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        return None
    L, d = rows.shape
    r = (rows - rows.mean(0)).double().cpu()
    if not float(r.norm()) > 0:
        return None
    for module in model.modules():
        for attr, v in (*module._buffers.items(), *vars(module).items()):
            if not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.dim() < 2 \
                    or v.shape[-1] != d or v.numel() < L * d:
                continue
            t = v.detach().reshape(-1, d)[:L].double().cpu()
            t = t - t.mean(0)
            s = float((t * r).sum() / t.pow(2).sum().clamp_min(1e-30))     # the scale fitted
            # 1e-3: the table and the embedding's position part agree to float32 rounding
            # (~1e-7); another tensor of the model misses by O(1)
            if float((s * t - r).norm()) <= 1e-3 * float(r.norm()):
                return _built_by(module, attr)
    return None


def _built_by(module, attr: str) -> dict | None:
    """The line that assigned `module.<attr>`, followed into the function it calls (see
    `table_line`); marked `"read"`."""
    at = _assignment(type(module), attr)
    if at is None:
        return None
    at["read"] = True
    try:
        stmt = ast.parse(textwrap.dedent(_statement(at["file"], at["line"])))
    except (SyntaxError, ValueError):
        return at
    fns = []
    for call in (n for n in ast.walk(stmt) if isinstance(n, ast.Call)):
        f = call.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
            fns.append(inspect.getattr_static(type(module), f.attr, None))
        elif isinstance(f, ast.Name):
            fns.append(getattr(sys.modules.get(type(module).__module__), f.id, None))
    for fn in fns:
        fn = getattr(fn, "__func__", fn)
        if not inspect.isfunction(fn):
            continue
        try:
            file = inspect.getsourcefile(fn)
            lines, first = inspect.getsourcelines(fn)
            tree = ast.parse(textwrap.dedent("".join(lines)))
        except (TypeError, OSError, SyntaxError):
            continue
        kind = file_kind(file) if file else None
        if kind is None:
            continue
        based = sorted({s.lineno for s in ast.walk(tree) if isinstance(s, ast.stmt)
                        and not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and any(isinstance(c, ast.Constant) and isinstance(c.value, (int, float))
                                and not isinstance(c.value, bool) and c.value >= 100
                                for c in ast.walk(s))})
        if len(based) == 1:
            loc = location(file, first + based[0] - 1, fn.__qualname__, kind)
            loc["read"] = True
            return loc
    return at


def _statement(file: str, line: int) -> str:
    """The statement that starts at `line` of `file` (continued over its lines)."""
    text = ""
    for n in range(line, line + 20):
        text += linecache.getline(file, n)
        try:
            ast.parse(textwrap.dedent(text))
            return text
        except SyntaxError:
            continue
    return text


def _assignment(cls, attr: str) -> dict | None:
    a = re.escape(attr)
    pattern = re.compile(rf"""register_(?:buffer|parameter)\(\s*["']{a}["']|self\.{a}\s*(?:,\s*self\.\w+\s*)*=(?!=)""")
    for klass in cls.__mro__:
        if klass.__module__.startswith(("torch.", "tndebug.")) or klass is object:
            continue
        try:
            file = inspect.getsourcefile(klass)
            lines, first = inspect.getsourcelines(klass)
        except (TypeError, OSError):
            continue
        kind = file_kind(file) if file else None
        if kind is None:
            continue
        for i, text in enumerate(lines):
            if pattern.search(text.split("#")[0]):
                defs = [m.group(1) for m in (re.match(r"\s*def (\w+)", t) for t in lines[:i]) if m]
                return location(file, first + i, f"{klass.__qualname__}.{defs[-1] if defs else '<class>'}", kind)
    return None


class TakenLines(TorchFunctionMode):
    """Where the output of each watched module is taken: for a module (an attention) called
    inside a block, the frame of the user's code, between the module's call and the block's own
    forward, that is still running when the output is first used by an op. A residual lost
    around the attention was lost there: the block's line `x = self.attn(self.ln_1(x))` when the
    output is next used in the block's forward (nanoGPT), the sublayer-connection's line
    `x = self.dropout(sublayer(self.norm(x)))` when that class's forward uses it first (the
    Annotated Transformer's SublayerConnection; the lambda passed to it has returned by then).
    The line given is the one that frame was at when it called the module.

    `watched`: module path -> the path of the block that holds it. For the probe's own forwards
    only (`with TakenLines(model, watched) as t: forward()`); `t.lines`: path -> location."""

    def __init__(self, model, watched: dict[str, str]) -> None:
        super().__init__()
        modules = dict(model.named_modules())
        self.watched = {p: modules[b] for p, b in watched.items() if p in modules and b in modules}
        self.modules = {p: modules[p] for p in self.watched}
        self.chains: dict[str, list] = {}          # path -> [(frame, line at the call)], inner first
        self.outputs: dict[int, tuple] = {}        # id(output) -> (path, the output: held)
        self.lines: dict[str, dict] = {}
        self.handles: list = []

    def __enter__(self):
        for path, mod in self.modules.items():
            self.handles.append(mod.register_forward_pre_hook(self._pre(path)))
            self.handles.append(mod.register_forward_hook(self._post(path)))
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles, self.chains, self.outputs = [], {}, {}     # no frame outlives the forward
        return super().__exit__(*exc)

    def _pre(self, path):
        block = self.watched[path]
        code = getattr(inspect.unwrap(type(block).forward), "__code__", None)

        def hook(mod, args):
            if path in self.chains or path in self.lines:
                return None                       # a module called again: its first call decides
            chain, frame = [], sys._getframe(1)
            while frame is not None:
                k = _file_kind(frame.f_code.co_filename)
                if k == _OURS:
                    return None                   # back in tndebug before the block's forward
                if k not in (_SKIP, _WRAP):
                    chain.append((frame, frame.f_lineno))
                    if frame.f_code is code:
                        self.chains[path] = chain
                        return None
                frame = frame.f_back
            return None
        return hook

    def _post(self, path):
        def hook(mod, args, out):
            t = out if isinstance(out, torch.Tensor) else \
                out[0] if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) else None
            if t is not None and path in self.chains and path not in self.lines:
                self.outputs[id(t)] = (path, t)
            return None
        return hook

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.outputs:
            try:
                self._taken(args, kwargs)
            except Exception:  # noqa: BLE001 - the line is a help, never breaks the forward
                pass
        return func(*args, **kwargs)

    def _taken(self, args, kwargs) -> None:
        for a in _tensors(args, kwargs):
            got = self.outputs.get(id(a))
            if got is None or got[1] is not a:
                continue
            caller = sys._getframe(2)
            if _user_frame(caller) is None:
                continue                          # tndebug's own op (a hook's copy)
            path = got[0]
            del self.outputs[id(a)]
            chain = self.chains.pop(path, [])
            live = set()
            frame = caller
            while frame is not None:
                live.add(id(frame))
                frame = frame.f_back
            frame, line = next(((f, n) for f, n in chain if id(f) in live), chain[-1] if chain else (None, 0))
            if frame is not None:
                code = frame.f_code
                self.lines[path] = location(code.co_filename, line,
                                            getattr(code, "co_qualname", code.co_name),
                                            _file_kind(code.co_filename))


class _OpLines(TorchFunctionMode):
    """id(tensor) -> (weak ref, the user's line of the op that returned it), for one run."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, tuple] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            if isinstance(out, torch.Tensor) and not any(out is a for a in _tensors(args, kwargs)):
                frame = _user_frame(sys._getframe(1))
                if frame is not None:
                    code = frame.f_code
                    self.made[id(out)] = (weakref.ref(out), (code.co_filename, frame.f_lineno,
                                          getattr(code, "co_qualname", code.co_name),
                                          _file_kind(code.co_filename)))
        except Exception:  # noqa: BLE001 - the notes never break the forward
            pass
        return out


def input_line(module, run) -> tuple[dict | None, tuple | None]:
    """The user's line of the op that made the first tensor `module` is called with (its
    first call) while `run()` runs, and that tensor's shape: for the first block of a stack,
    the line that made what enters the stack (`x = self.tok(ids)`, where an absolute position
    table is added). For a probe's own forward; the line is None when that op is not the
    user's, both are None when `run` raised or the module was not called."""
    mode, got = _OpLines(), {}

    def pre(mod, args, kwargs):
        if "x" not in got:
            got["x"] = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    handle = module.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with mode:
            run()
    except Exception:  # noqa: BLE001 - the line is a help, the finding stands without it
        return None, None
    finally:
        handle.remove()
    x = got.get("x")
    if x is None:
        return None, None
    e = mode.made.get(id(x))
    return (_loc(e[1]) if e is not None and e[0]() is x else None), tuple(x.shape)


class _PassOps(TorchFunctionMode):
    """Per forward of `root` (a pass): [(where, a copy of the output)] for every op the user's
    code ran, in order; at most `budget` elements copied in all (a large model: the rest is not
    noted)."""

    def __init__(self, root, budget: int = 20_000_000) -> None:
        super().__init__()
        self.passes: list[list] = []
        self.budget, self.root, self.handles, self.open = budget, root, [], False

    def _begin(self, mod, args) -> None:
        self.passes.append([])
        self.open = True

    def _end(self, mod, args, out) -> None:
        self.open = False                          # the adapter's own ops after the forward

    def __enter__(self):
        self.handles = [self.root.register_forward_pre_hook(self._begin),
                        self.root.register_forward_hook(self._end)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            if self.open and isinstance(out, torch.Tensor) and self.budget > out.numel():
                frame = _user_frame(sys._getframe(1))
                if frame is not None:
                    code = frame.f_code
                    self.budget -= out.numel()
                    self.passes[-1].append(((code.co_filename, frame.f_lineno,
                                             getattr(code, "co_qualname", code.co_name),
                                             _file_kind(code.co_filename)), out.detach().clone()))
        except Exception:  # noqa: BLE001 - the notes never break the forward
            pass
        return out


def _aligned(full: torch.Tensor, step: torch.Tensor, pos: int):
    """`full`'s part that a cached step at position `pos` computes: along each axis where the
    step's is shorter (c), positions pos - c + 1 .. pos (the new token's row: c = 1; the keys
    0..pos: c = pos + 1); None when the shapes cannot correspond."""
    if full.dim() != step.dim() or full.dtype.is_complex or step.dtype.is_complex:
        return None
    for i, (f, c) in enumerate(zip(full.shape, step.shape)):
        if c > f or (c < f and (pos + 1 > f or pos - c + 1 < 0)):
            return None
        if c < f:
            full = full.narrow(i, pos - c + 1, c)
    return full


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point or b.dtype.is_floating_point:
        a, b = a.double(), b.double()
        fa, fb = torch.isfinite(a), torch.isfinite(b)
        if not torch.equal(fa, fb) or not torch.equal(a[~fa], b[~fb]):   # -inf where masked
            return False
        if not bool(fa.any()):
            return True
        # 1e-4 of the tensor's size: a cached step reruns the same ops on fewer rows, equal to
        # float32 rounding (~1e-7 relative); a wrong position, key or mask moves it by O(1)
        return float((a[fa] - b[fa]).abs().max()) <= 1e-4 * (1 + float(a[fa].abs().max()))
    return bool(torch.equal(a, b))


def cache_divergence(model, full, cached, pos: int, step: int = 1) -> dict | None:
    """The user's line where a KV-cached step first computes something the full forward does
    not: `full()` runs the whole rows once, `cached()` decodes them through the cache (its
    `step`-th forward of `model` decodes position `pos`). The step's ops are taken in order,
    each matched to the full pass's op of the same line and the same occurrence, and its output
    compared with the full output's part at that position (`_aligned`); an op only the cached
    step runs (`torch.cat((past_k, k))`) is matched to any full-pass op of its file. The
    first op that matches nothing is where the cache's computation leaves the full forward's:
    positions restarted, the values concatenated from the keys, a mask not offset by the
    cache's length. For a probe's own forwards, once a cache finding is made; None when every
    op matches or nothing was noted."""
    a, b = _PassOps(model), _PassOps(model)
    try:
        with a:
            full()
        with b:
            cached()
    except Exception:  # noqa: BLE001 - the line is a help, the finding stands without it
        return None
    if not a.passes or len(b.passes) <= step:
        return None
    by_line: dict = {}
    for where, out in a.passes[0]:
        by_line.setdefault(where[:2], []).append(out)
    by_file: dict = {}
    for where, out in a.passes[0]:
        by_file.setdefault(where[0], []).append(out)
    seen: dict = {}
    for where, out in b.passes[step]:
        n = seen.get(where[:2], 0)
        seen[where[:2]] = n + 1
        same_line = by_line.get(where[:2], [])
        cands = [same_line[n]] if n < len(same_line) else by_file.get(where[0], [])
        parts = [p for p in (_aligned(f, out, pos) for f in cands) if p is not None and p.shape == out.shape]
        if parts and not any(_same(p, out) for p in parts):
            return _loc(where)
    return None


_RANDOM = frozenset({"rand", "randn", "rand_like", "randn_like", "randint", "randint_like",
                     "randperm", "bernoulli", "bernoulli_", "normal", "normal_", "uniform_",
                     "multinomial", "exponential_", "geometric_", "random_"})
_DROPOUTS = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
                       "feature_alpha_dropout", "dropout_", "native_dropout"})


def _random(func, args, kwargs) -> bool:
    """An op that draws random numbers as called: a dropout with training on and p > 0, or a
    sampling op."""
    name = getattr(func, "__name__", "")
    if name in _RANDOM:
        return True
    if name not in _DROPOUTS:
        return False
    p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
    train = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
    return bool(train) and isinstance(p, (int, float)) and p > 0


class _RandomOps(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.found: dict | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.found is None:
            try:
                if _random(func, args, kwargs):
                    frame = sys._getframe(1)
                    while frame is not None and _file_kind(frame.f_code.co_filename) in (_OURS, _WRAP):
                        frame = frame.f_back
                    frame = _user_frame(frame)
                    if frame is not None:
                        code = frame.f_code
                        self.found = location(code.co_filename, frame.f_lineno,
                                              getattr(code, "co_qualname", code.co_name),
                                              _file_kind(code.co_filename))
            except Exception:  # noqa: BLE001 - the search never breaks the call
                pass
        return func(*args, **kwargs)


def random_op_line(run) -> dict | None:
    """The user's line of the first op that draws random numbers while `run()` runs (a bare
    F.dropout(x, p) left on in eval mode), as a location; None when none is found in the user's
    code. For a finding that eval outputs are not repeatable; `run` is called once."""
    mode = _RandomOps()
    try:
        with mode:
            run()
    except Exception:  # noqa: BLE001 - the line is a help, the finding stands without it
        return None
    return mode.found
