"""Test-harness speed-ups for Triton's interpreter (TRITON_INTERPRET=1); not part of tpsample.

Two of the interpreter's (Triton 3.6) host costs grow with how often our kernels call small
jit helpers and create tensors, and took about 40 % of an interpreted test's time:

- it patches `triton.language` for the interpreter at every call of a @triton.jit function:
  once per kernel launch (undone when the launch ends), and again at every call of a jit
  helper inside the kernel, where the launch's patch is already in place. Each patch walks
  the modules with `inspect.getmembers`. `install()` makes a helper's call skip the patch
  when the running launch has already patched every language module the helper's globals
  hold (the same modules, patched the same way: the repeat would set nothing new). A helper
  that sees another module is patched as before, and so is every launch.
- `_get_np_dtype` builds its dtype table at every call; `install()` gives it a table built
  once (the same entries, the same lookups).

Where the interpreter's internals are not what is expected here, nothing is changed.
"""
import inspect

_launch: list = []  # the running launch's language modules (ids), while one runs (launches
# do not nest: a kernel calls jit helpers, never another launch)
_langs_of: dict = {}  # a jit function's globals (by id) -> the ids of its language modules


def _langs(fn, tl):
    g = fn.__globals__
    langs = _langs_of.get(id(g))
    if langs is None:
        langs = frozenset(id(v) for v in g.values() if inspect.ismodule(v) and v in (tl, tl.core))
        _langs_of[id(g)] = langs  # (module globals live as long as their module)
    return langs


def _patch_once(interpreter, tl) -> bool:
    original = interpreter._patch_lang
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if getattr(original, "_patch_once", False):
        return True
    if scope_type is None or not callable(getattr(scope_type, "restore", None)):
        return False

    class LaunchScope(scope_type):
        """A launch's patch: once it is undone, no launch runs."""

        def __init__(self, inner):
            self.__dict__.update(inner.__dict__)

        def restore(self):
            try:
                super().restore()
            finally:
                _launch.clear()

    def patch_lang(fn):
        langs = _langs(fn, tl)
        if _launch and langs <= _launch[0]:
            return scope_type()  # already patched by the running launch: nothing to undo
        scope = original(fn)
        if _launch:  # a helper that sees another module: patched as the interpreter does
            _launch[0].update(langs)
            return scope
        _launch.append(set(langs))
        return LaunchScope(scope)

    patch_lang._patch_once = True
    interpreter._patch_lang = patch_lang
    return True


def _dtype_table(interpreter, tl, np) -> bool:
    original = interpreter._get_np_dtype
    if getattr(original, "_table", None) is not None:
        return True
    names = ("int1", "float16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32",
             "uint32", "int64", "uint64", "bfloat16", "float8e5", "float8e5b16", "float8e4nv",
             "float8e4b8", "float8e4b15")
    try:
        table = {getattr(tl, n): original(getattr(tl, n)) for n in names}
    except (AttributeError, KeyError):
        return False
    pointer, block = tl.pointer_type, tl.block_type
    u64 = np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, pointer):
            return u64
        if isinstance(tt_dtype, block):
            tt_dtype = tt_dtype.element_ty
            if isinstance(tt_dtype, pointer):
                return u64
        found = table.get(tt_dtype)
        return original(tt_dtype) if found is None else found  # (a dtype not listed here)

    get_np_dtype._table = table
    interpreter._get_np_dtype = get_np_dtype
    return True


def install() -> bool:
    """Apply both speed-ups (once per process); True when both are in place."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
        interpreter._patch_lang, interpreter._get_np_dtype  # noqa: B018 (both present)
    except (ImportError, AttributeError):
        return False
    return _patch_once(interpreter, tl) & _dtype_table(interpreter, tl, np)
