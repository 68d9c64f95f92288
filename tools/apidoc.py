"""Generate docs/api.md, the API reference, from the live package: every name in `hcq.__all__` plus the backend
contract, each class with its public methods and properties (signature as `inspect.signature` gives it,
annotations as written) and the first paragraph of each docstring.

    python -m tools.apidoc            write docs/api.md
    python -m tools.apidoc --check    exit 1 if docs/api.md differs from what would be written
    python -m tools.apidoc --stdout   print the page instead of writing it

The output depends only on the source (definition order, docstrings, `# comments` on attribute lines), never on
the environment or on runtime state, so it is the same on every run; tests/test_apidoc.py checks that the checked-in
page is current and that every public callable listed has a docstring."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import importlib
import inspect
import io
import os
import sys
import textwrap
import tokenize
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import hcq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_PATH = os.path.join(ROOT, "docs", "api.md")
SRC_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(hcq.__file__)))  # locations read "hcq/...", wherever hcq is
REGEN = "python -m tools.apidoc"
IMPLEMENTATION_BASES = ("hcq._hotpath", "hcq.hotpath")  # how a class is built (the launch hot path), not API: not listed as bases

# Sections of the page, in order: (title, intro, names). A bare name is looked up in `hcq`; "module:name" names
# something outside `hcq.__all__`. Names of `hcq.__all__` that no section lists land in a final "Other" section,
# so a new export shows up on the page (and the page check fails until it is regenerated) rather than vanishing.
SECTIONS: list[tuple[str, str, list[str]]] = [
    ("Devices and the registry",
     "`hcq.Device(name)` opens a device once and caches it; the object it returns is an `HCQCompiled`.",
     ["Device", "available_backends", "opened_devices", "HCQCompiled", "TimelineRing"]),
    ("Memory",
     "What to allocate (`BufferSpec`), what an allocation is (`HCQBuffer`), and host access to it (`MMIOInterface`).",
     ["BufferSpec", "HCQBuffer", "MMIOInterface"]),
    ("The allocator",
     "`dev.allocator`: allocation, freeing and every host/device copy.",
     ["HCQAllocator"]),
    ("Queues",
     "`dev.hw_compute_queue_t()` / `dev.hw_copy_queue_t(index)` build an `HWQueue`; every command returns the queue, "
     "so they chain, and `submit` hands it to the device.",
     ["HWQueue", "PollCondition"]),
    ("Signals",
     "`dev.new_signal(value=0)` makes one; queues `signal` / `wait` / `timestamp` on it, the host `load`s, `store`s "
     "and `wait`s.",
     ["HCQSignal"]),
    ("Programs",
     "`dev.compile(source, name)` returns an `HCQProgram`; `prg.fill_kernargs(bufs, vals)` an args state for "
     "`HWQueue.exec`.",
     ["HCQProgram", "HCQArgsState", "CLikeArgsState", "ArgSlot"]),
    ("Graphs",
     "Record launches and copies once, replay them with new inputs and variable values.",
     ["HCQGraph", "ExecItem", "CopyItem", "GraphEntry", "capture", "Capture", "jit"]),
    ("Profiling",
     "`with hcq.profile() as p:` (or `PROFILE=1` for the whole process).",
     ["profile", "Profiler", "Event"]),
    ("Errors",
     "Runtime failures raise a subclass of `HCQError`; bad arguments raise `ValueError` / `TypeError`.",
     ["HCQError", "DeviceError", "HCQTimeoutError", "QueueKindError", "CompileError", "WaitInterrupted",
      "ValidationError", "NotHostVisibleError", "UnboundVariableError"]),
    ("Symbolic values",
     "A `Variable` (or an expression over one) may stand anywhere a queue takes a value, address, size or grid "
     "dimension; its value is given at each submit.",
     ["Variable", "Expr", "sint"]),
    ("The backend contract",
     "What a backend declares and supplies (the full walk-through is [backends.md](backends.md)).",
     ["Capabilities", "register_backend", "hcq.packet_queue:Executor", "hcq.packet_queue:SubmitStatus",
      "hcq.packet_queue:RingState", "hcq.stream_queue:StreamOps", "hcq.stream_queue:DeviceFault",
      "hcq.stream_device:StreamDevice", "hcq.backend:contract_problems"]),
]

# The "Common questions" block: each answer is written here, and the facts it rests on are checked against the live
# docstrings and signatures when the page is generated, so a change that makes an answer wrong stops the generator
# (edit the answer below, then regenerate) instead of leaving a page that contradicts the code.
QUESTIONS: list[dict[str, Any]] = [
    {"q": "How do I free a buffer?",
     "a": "`dev.allocator.free(buf, nbytes, spec)`: pass the size it was allocated with and the same `BufferSpec` "
          "(omit it if you allocated without one). A view (`buf.offset(...)`) cannot be freed, only its allocation; "
          "the memory is reused or released only once no submitted work can still use it. "
          "`dev.allocator.free_cache()` releases what the LRU cache holds.",
     "cites": ["HCQAllocator.free", "HCQAllocator.free_cache"],
     "facts": [("hcq.allocator:HCQAllocator.free", "params", ["buf", "size", "options"]),
               ("hcq.allocator:HCQAllocator.free", "doc", "same `size` and `options`")]},
    {"q": "What does `copy` take: buffers or device addresses?",
     "a": "Either. `q.copy(dest, src, nbytes)` on a copy queue (`dev.hw_copy_queue_t()`) takes `HCQBuffer`s or "
          "device addresses (ints, or symbolic expressions) for `dest` and `src`; a buffer gives its `va_addr`. "
          "Host memory goes through the allocator instead: `copyin(buf, memoryview)`, `copyout(memoryview, buf)`, "
          "and `transfer(...)` between devices.",
     "cites": ["HWQueue.copy"],
     "facts": [("hcq.queue:HWQueue.copy", "params", ["dest", "src", "copy_size", "guard"]),
               ("hcq.queue:HWQueue.copy", "doc", "buffers give their address"),
               ("hcq.queue:HWQueue.copy", "doc", "Copy queues only")]},
    {"q": "Does `.signal()` record a time?",
     "a": "No. `q.signal(sig, v)` stores the value `v` only; the timestamp word of a signal is written by a "
          "`q.timestamp(sig)` packet. To time work, bracket it: `q.timestamp(st).exec(...).timestamp(en)`, then "
          "`en.timestamp - st.timestamp` is microseconds (a `Decimal`).",
     "cites": ["HWQueue.signal", "HWQueue.timestamp", "HCQSignal.timestamp"],
     "facts": [("hcq.queue:HWQueue.signal", "doc", "Set `signal` to `value`"),
               ("hcq.queue:HWQueue.timestamp", "doc", "Record the current device time"),
               ("hcq.signal:HCQSignal.timestamp", "doc", "microseconds")]},
]

DUNDER_PROTOCOLS = {"__enter__": "`with`", "__len__": "`len()`", "__getitem__": "`x[i]`", "__setitem__": "`x[i] = v`",
                    "__iter__": "iteration", "__contains__": "`in`", "__index__": "`operator.index()`"}
_ABSENT = object()


class ApiDocError(Exception):
    """The generator cannot produce a page it can vouch for (e.g. a common-questions answer no longer matches the code)."""


@dataclass
class Entry:
    """One listed item. `kind`: class, function, method, property, attribute, member (of an enum), constant, alias.
    `checked`: a callable (or property) whose docstring test 2 requires."""
    qualname: str
    kind: str
    signature: str
    doc: str
    has_doc: bool
    location: str
    checked: bool = True


@dataclass
class ClassDoc:
    entry: Entry
    bases: list[str]
    constructor: str | None
    attributes: list[Entry] = field(default_factory=list)
    members: list[Entry] = field(default_factory=list)
    aliases: list[tuple[list[str], list[str]]] = field(default_factory=list)  # (alias names, what they alias)
    inherited: list[tuple[str, list[str]]] = field(default_factory=list)  # (base, member names)
    protocols: list[str] = field(default_factory=list)


# ---- looking things up
def resolve(ref: str) -> tuple[str, Any]:
    """(display name, object) for a SECTIONS / QUESTIONS reference: "Name" (in hcq) or "module:Qual.Name"."""
    if ":" not in ref: return f"hcq.{ref}", getattr(hcq, ref)
    module_name, qual = ref.split(":")
    obj: Any = importlib.import_module(module_name)
    for part in qual.split("."): obj = inspect.getattr_static(obj, part) if isinstance(obj, type) else getattr(obj, part)
    return f"{module_name}.{qual}", obj


def _unwrap(obj: Any) -> Any:
    if isinstance(obj, (staticmethod, classmethod)): obj = obj.__func__
    if isinstance(obj, property): obj = obj.fget
    if isinstance(obj, functools.cached_property): obj = obj.func
    return inspect.unwrap(obj) if callable(obj) else obj


def location(obj: Any) -> str:
    """"path:line" of the `def` / `class` line, relative to the repository root."""
    target = _unwrap(obj)
    path = inspect.getsourcefile(target) or "?"
    lines, start = inspect.getsourcelines(target)
    for i, line in enumerate(lines):  # skip decorators
        if line.lstrip().startswith(("def ", "async def ", "class ")):
            start += i
            break
    return f"{os.path.relpath(path, SRC_ROOT)}:{start}"


def own_doc(obj: Any) -> str | None:
    """The object's own docstring (not one inherited, nor one `dataclass` made up from the signature)."""
    target = obj.fget if isinstance(obj, property) else obj
    if isinstance(target, (staticmethod, classmethod)): target = target.__func__
    doc = target.__dict__.get("__doc__") if isinstance(target, type) else getattr(target, "__doc__", None)
    if isinstance(target, type) and dataclasses.is_dataclass(target) and doc and doc.startswith(target.__name__ + "("): return None
    return doc if doc and doc.strip() else None


def first_paragraph(doc: str | None) -> str:
    if not doc: return ""
    para = inspect.cleandoc(doc).split("\n\n")[0]
    return " ".join(line.strip() for line in para.splitlines())


# ---- signatures
class _Raw:
    """Prints as the given text (annotations as written, defaults as chosen) inside `inspect.Signature.__str__`."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def format_annotation(ann: Any) -> str:
    return ann if isinstance(ann, str) else inspect.formatannotation(ann)


def format_value(v: Any) -> str:
    """A default or constant as text that is the same in every process (no addresses)."""
    if isinstance(v, enum.Enum): return f"{type(v).__name__}.{v.name}"
    if isinstance(v, (frozenset, set)) and all(isinstance(x, enum.Enum) for x in v):
        inner = ", ".join(format_value(x) for x in sorted(v, key=lambda x: x.value))
        return f"{type(v).__name__}({{{inner}}})" if v else f"{type(v).__name__}()"
    if isinstance(v, type): return v.__qualname__
    text = repr(v)
    if " at 0x" in text: raise ApiDocError(f"default or constant {text} has no stable text; teach tools/apidoc.format_value about it")
    return text


def format_signature(fn: Any, drop_first: bool = False, factories: dict[str, Callable[[], Any]] | None = None,
                     returns: bool = True) -> str:
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if drop_first and params: params = params[1:]
    out = []
    for p in params:
        ann = p.annotation if p.annotation is inspect.Parameter.empty else _Raw(format_annotation(p.annotation))
        default = p.default
        if default is not inspect.Parameter.empty:
            if factories and p.name in factories: default = _Raw(format_value(factories[p.name]()))
            else: default = _Raw(format_value(default))
        out.append(p.replace(annotation=ann, default=default))
    ret = sig.return_annotation
    ret = inspect.Signature.empty if ret is inspect.Signature.empty or not returns else _Raw(format_annotation(ret))
    return str(sig.replace(parameters=out, return_annotation=ret))


# ---- source-level facts (attribute lines and their comments)
@functools.lru_cache(maxsize=None)
def _comments(path: str) -> dict[int, str]:
    """line -> the `# comment` ending it."""
    with open(path, encoding="utf-8") as f: src = f.read()
    return {tok.start[0]: tok.string.lstrip("#").strip() for tok in tokenize.generate_tokens(io.StringIO(src).readline)
            if tok.type == tokenize.COMMENT}


def _class_ast(cls: type) -> tuple[ast.ClassDef, str, int]:
    lines, start = inspect.getsourcelines(cls)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    node = tree.body[0]
    assert isinstance(node, ast.ClassDef)
    return node, inspect.getsourcefile(cls) or "", start - 1


def _targets(node: ast.stmt) -> Iterator[tuple[ast.expr, ast.expr | None, str | None]]:
    """(target, value, annotation as written) of an assignment, tuple assignments split pairwise."""
    if isinstance(node, ast.AnnAssign):
        yield node.target, node.value, ast.unparse(node.annotation)
    elif isinstance(node, ast.Assign):
        for t in node.targets:
            if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple) and len(t.elts) == len(node.value.elts):
                yield from ((a, b, None) for a, b in zip(t.elts, node.value.elts))
            elif isinstance(t, ast.Tuple):
                yield from ((a, None, None) for a in t.elts)
            else:
                yield t, node.value, None


def class_attributes(cls: type, qual: str) -> list[Entry]:
    """Public data attributes of the class body and of `self.NAME = ...` in its `__init__`, in source order, with
    the annotation as written (for `self.x = x`, the annotation of parameter `x`) and the comment ending the line."""
    node, path, offset = _class_ast(cls)
    comments = _comments(path)
    rel = os.path.relpath(path, SRC_ROOT)
    out: dict[str, Entry] = {}
    is_dc = dataclasses.is_dataclass(cls)
    is_enum = isinstance(cls, enum.EnumMeta)
    for stmt in node.body:
        for target, _value, ann in _targets(stmt):
            if not isinstance(target, ast.Name) or target.id.startswith("_") or target.id in out: continue
            name = target.id
            if is_dc and name in {f.name for f in dataclasses.fields(cls)}: continue  # in the constructor
            line = offset + stmt.lineno
            live = cls.__dict__.get(name, _ABSENT)
            if live is not _ABSENT and callable(live) and not isinstance(live, enum.Enum): continue  # `alias = method`: not data
            if is_enum:
                sig = f"{name} = {live.value!r}"
                kind = "member"
            else:
                sig = name + (f": {ann}" if ann else "")
                if live is not _ABSENT and isinstance(live, (int, float, str, bytes, bool, tuple, frozenset, type(None))):
                    sig += f" = {format_value(live)}"  # immutable values only: a mutable one may hold runtime state
                kind = "attribute"
            out[name] = Entry(f"{qual}.{name}", kind, sig, comments.get(line, ""), bool(comments.get(line)), f"{rel}:{line}", checked=False)
    init = next((s for s in node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
    if init is not None:
        params = {a.arg: ast.unparse(a.annotation) for a in init.args.args + init.args.kwonlyargs if a.annotation is not None}
        for node_ in ast.walk(init):
            if not isinstance(node_, (ast.Assign, ast.AnnAssign)): continue
            stmt = node_
            for target, value, ann in _targets(stmt):
                if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"): continue
                name = target.attr
                if name.startswith("_") or name in out or _defined_in_hcq_class(cls, name): continue
                if ann is None and isinstance(value, ast.Name): ann = params.get(value.id)
                line = offset + stmt.lineno
                out[name] = Entry(f"{qual}.{name}", "attribute", name + (f": {ann}" if ann else ""), comments.get(line, ""),
                                  bool(comments.get(line)), f"{rel}:{line}", checked=False)
    return sorted(out.values(), key=lambda e: int(e.location.rsplit(":", 1)[1]))


def _defined_in_hcq_class(cls: type, name: str) -> bool:
    """Whether `name` is a method/property of the class (an `__init__` assignment to it is not a separate attribute)."""
    for k in cls.__mro__:
        if name in k.__dict__ and callable(_unwrap(k.__dict__[name])): return True
        if name in k.__dict__ and isinstance(k.__dict__[name], property): return True
    return False


# ---- classes and functions
def _is_hcq(obj: Any) -> bool:
    return (getattr(obj, "__module__", "") or "").split(".")[0] in ("hcq", "tools", "tests")


def _member_entry(cls: type, qual: str, name: str, raw: Any) -> Entry | None:
    shown = name
    if isinstance(raw, property):
        kind = "property" + (" (settable)" if raw.fset is not None else "")
        ret = inspect.signature(raw.fget).return_annotation if raw.fget else inspect.Signature.empty
        sig = name + ("" if ret is inspect.Signature.empty else f" -> {format_annotation(ret)}")
    elif isinstance(raw, functools.cached_property):
        kind = "property (cached)"
        ret = inspect.signature(raw.func).return_annotation
        sig = name + ("" if ret is inspect.Signature.empty else f" -> {format_annotation(ret)}")
    elif isinstance(raw, staticmethod):
        kind, sig = "staticmethod", shown + format_signature(raw.__func__)
    elif isinstance(raw, classmethod):
        kind, sig = "classmethod", shown + format_signature(raw.__func__, drop_first=True)
    elif inspect.isfunction(raw) or (callable(raw) and hasattr(raw, "__wrapped__")):
        kind = "abstract method" if getattr(raw, "__isabstractmethod__", False) else "method"
        sig = shown + format_signature(raw, drop_first=True)
    else:
        return None
    doc = own_doc(raw)
    return Entry(f"{qual}.{name}", kind, sig, first_paragraph(doc), doc is not None, location(raw))


def document_class(cls: type, qual: str, documented: set[type]) -> ClassDoc:
    doc = own_doc(cls)
    bases = [b.__qualname__ for b in cls.__bases__ if b is not object and b.__module__ not in ("typing", *IMPLEMENTATION_BASES)]
    constructor = None
    if isinstance(cls, enum.EnumMeta):
        pass
    elif dataclasses.is_dataclass(cls) or any("__init__" in k.__dict__ for k in cls.__mro__ if _is_hcq(k)):
        factories = {f.name: f.default_factory for f in dataclasses.fields(cls) if f.default_factory is not dataclasses.MISSING} \
            if dataclasses.is_dataclass(cls) else None
        init = inspect.getattr_static(cls, "__init__")
        constructor = cls.__name__ + format_signature(init, drop_first=True, factories=factories, returns=False)
    cd = ClassDoc(Entry(qual, "class", constructor or cls.__name__, first_paragraph(doc), doc is not None, location(cls)), bases, constructor)
    cd.attributes = class_attributes(cls, qual)
    seen: dict[int, str] = {}
    own = cls.__dict__
    for name, raw in own.items():
        if name.startswith("__") and name.endswith("__"):
            if name == "__call__" and callable(raw):
                entry = _member_entry(cls, qual, name, raw)
                if entry is not None: cd.members.append(entry)
            elif name in DUNDER_PROTOCOLS and callable(raw):
                cd.protocols.append(DUNDER_PROTOCOLS[name])
            continue
        target = _unwrap(raw)
        if name.startswith("_"):  # documented aliases only: an underscore name bound to a public member of the class
            if (public := seen.get(id(target))) is not None: cd.aliases.append(([name], [public]))
            continue
        if id(target) in seen and callable(target):  # a public alias of another public member
            cd.aliases.append(([name], [seen[id(target)]]))
            continue
        entry = _member_entry(cls, qual, name, raw)
        if entry is None: continue
        seen[id(target)] = name
        cd.members.append(entry)
    cd.aliases = _merge_aliases(cd.aliases)
    # members inherited from other hcq classes: one line naming them when that class is on the page, else in full
    listed = set(own) | {e.qualname.split(".")[-1] for e in cd.attributes}
    for base in cls.__mro__[1:]:
        if not _is_hcq(base) or base.__module__ in IMPLEMENTATION_BASES: continue
        if base in documented:
            bd = document_class(base, base.__qualname__, set())
            names = [n for n in (e.qualname.split(".")[-1] for e in bd.members + bd.attributes) if n not in listed]
            listed.update(names)
            if names: cd.inherited.append((base.__qualname__, names))
            continue
        for name, raw in base.__dict__.items():
            if name in listed or (name.startswith("_") and name != "__call__"): continue
            listed.add(name)
            entry = _member_entry(base, qual, name, raw)
            if entry is not None: cd.members.append(entry)
    return cd


def _merge_aliases(aliases: list[tuple[list[str], list[str]]]) -> list[tuple[list[str], list[str]]]:
    if not aliases: return []
    private = [(n[0], t[0]) for n, t in aliases if n[0].startswith("_")]
    public = [(n[0], t[0]) for n, t in aliases if not n[0].startswith("_")]
    out = []
    if private: out.append(([a for a, _ in private], [b for _, b in private]))
    out.extend(([a], [b]) for a, b in public)
    return out


@dataclass
class Item:
    name: str  # as shown, e.g. hcq.HCQAllocator
    obj: Any
    cls: ClassDoc | None = None
    entry: Entry | None = None


def _module_constant(name: str) -> Entry:
    """A non-callable export (e.g. the type alias `sint`): its assignment as written and the comment ending it."""
    for mod_name in sorted(m for m in sys.modules if m == "hcq" or m.startswith("hcq.")):
        mod = sys.modules[mod_name]
        path = getattr(mod, "__file__", None)
        if not path or not path.endswith(".py"): continue
        with open(path, encoding="utf-8") as f: tree = ast.parse(f.read())
        for stmt in tree.body:
            for target, value, ann in _targets(stmt):
                if isinstance(target, ast.Name) and target.id == name and value is not None and getattr(mod, name, None) is getattr(hcq, name):
                    line = _comments(path).get(stmt.lineno, "")
                    return Entry(f"hcq.{name}", "constant", f"{name} = {ast.unparse(value)}", line, bool(line),
                                 f"{os.path.relpath(path, SRC_ROOT)}:{stmt.lineno}", checked=False)
    value = getattr(hcq, name)
    return Entry(f"hcq.{name}", "constant", f"{name} = {format_value(value)}", "", False, "?", checked=False)


def collect() -> list[tuple[str, str, list[Item]]]:
    """The page's content: (section title, intro, items) in page order."""
    placed = {n for _, _, names in SECTIONS for n in names if ":" not in n}
    sections = list(SECTIONS)
    if missing := [n for n in hcq.__all__ if n not in placed]:
        sections.append(("Other", "Exports not yet placed in a section of tools/apidoc.py.", missing))
    resolved = [(title, intro, [resolve(n) for n in names]) for title, intro, names in sections]
    documented = {obj for _, _, objs in resolved for _, obj in objs if isinstance(obj, type)}
    out = []
    for title, intro, objs in resolved:
        items = []
        for shown, obj in objs:
            if isinstance(obj, type):
                items.append(Item(shown, obj, cls=document_class(obj, shown.split(".")[-1], documented)))
            elif inspect.isroutine(obj):
                doc = own_doc(obj)
                items.append(Item(shown, obj, entry=Entry(shown, "function", shown.split(".")[-1] + format_signature(obj),
                                                          first_paragraph(doc), doc is not None, location(obj))))
            else:
                items.append(Item(shown, obj, entry=_module_constant(shown.split(".")[-1])))
        out.append((title, intro, items))
    return out


def entries(content: list[tuple[str, str, list[Item]]] | None = None) -> list[Entry]:
    """Every entry on the page (classes, functions, members, attributes), in page order."""
    out = []
    for _, _, items in content if content is not None else collect():
        for it in items:
            if it.cls is not None: out += [it.cls.entry, *it.cls.members, *it.cls.attributes]
            elif it.entry is not None: out.append(it.entry)
    return out


def missing_docstrings() -> list[Entry]:
    """Listed callables (classes, functions, methods, properties) without a docstring of their own."""
    return [e for e in entries() if e.checked and not e.has_doc]


# ---- rendering
def _anchor(title: str) -> str:
    return "".join(c for c in title.lower().replace(" ", "-") if c.isalnum() or c in "-_")


def _file(e: Entry) -> str:
    """Where it is defined, without the line: line numbers would make every edit above a definition stale the page."""
    return e.location.rsplit(":", 1)[0]


def _check_facts() -> None:
    for q in QUESTIONS:
        for ref, what, expected in q["facts"]:
            _, obj = resolve(ref)
            got: Any
            if what == "params":
                got = list(inspect.signature(_unwrap(obj)).parameters)[1:]
                ok = got == expected
            else:
                got = own_doc(obj) or ""
                ok = expected in " ".join(got.split())
            if not ok:
                raise ApiDocError(f"the common-questions answer to {q['q']!r} rests on {ref} ({what}: {expected!r}), which no "
                                  f"longer holds (found {got!r}); update QUESTIONS in tools/apidoc.py, then run {REGEN}")


def wrap_call(text: str, width: int = 100) -> str:
    """`name(a, b) -> r` with one parameter a line when it is longer than `width`."""
    if len(text) <= width or "(" not in text: return text
    start = text.index("(")
    depth, quote, parts, cur, end = 0, "", [], "", len(text)
    for i in range(start + 1, len(text)):
        c = text[i]
        if quote:
            if c == quote: quote = ""
        elif c in "'\"": quote = c
        elif c in "([{": depth += 1
        elif c in ")]}":
            if depth == 0:
                end = i
                break
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
            continue
        cur += c
    if cur.strip(): parts.append(cur.strip())
    return text[:start + 1] + "\n" + "".join(f"    {p},\n" for p in parts) + text[end:]


def _bullet(e: Entry) -> str:
    doc = e.doc if e.doc else "*(no docstring)*" if e.checked else ""
    kind = f"{e.kind} " if e.kind.startswith(("property", "staticmethod", "classmethod", "abstract")) else ""
    return f"- {kind}`{e.signature}`" + (f" — {doc}" if doc else "")


def render() -> str:
    _check_facts()
    content = collect()
    lines = [
        "# hcq API reference",
        "",
        f"<!-- Generated by `{REGEN}` from the docstrings of the live package; do not edit by hand. -->",
        "",
        "Every name in `hcq.__all__`, grouped, plus the backend contract. For each class: its constructor, public",
        "methods and properties (signatures as `inspect.signature` gives them, annotations as written) and the first",
        "paragraph of each docstring; attributes with the comment on their line in the source.",
        "",
        "## Orientation",
        "",
        "`import hcq` is all a program needs (`from hcq import arrays` adds numpy helpers). Most programs touch three",
        "objects:",
        "",
        "- `dev = hcq.Device(\"CPU\")`: the device ([`HCQCompiled`](#hcqcompiled)); `dev.compile(source, name)` gives a",
        "  program, `dev.synchronize()` waits for everything submitted, `dev.new_signal()` gives a signal.",
        "- `dev.allocator` ([`HCQAllocator`](#hcqallocator)): `alloc(nbytes, BufferSpec(...))`, `free(buf, nbytes, spec)`,",
        "  `copyin(buf, memoryview)`, `copyout(memoryview, buf)`, `transfer(...)` between devices.",
        "- `q = dev.hw_compute_queue_t()` (or `dev.hw_copy_queue_t(index)`) ([`HWQueue`](#hwqueue)): chain commands",
        "  (`wait`, `exec`, `copy`, `signal`, `timestamp`, ...), then `q.submit(dev, var_vals)`.",
        "",
        "## Common questions",
        "",
    ]
    all_entries = {e.qualname: e for e in entries(content)}
    for q in QUESTIONS:
        lines += [f"**{q['q']}** {q['a']}", ""]
        for qual in q["cites"]:  # the calls the answer rests on, as the page lists them
            e = all_entries[qual]
            owner = qual.rsplit(".", 1)[0]
            what = " (property)" if e.kind.startswith("property") else ""
            lines.append(f"> - `{owner}.{e.signature}`{what} — {e.doc}")
        lines.append("")
    lines += ["## Contents", ""]
    for title, _, items in content:
        names = ", ".join(f"`{it.name.split('.')[-1]}`" for it in items)
        lines.append(f"- [{title}](#{_anchor(title)}): {names}")
    lines.append("")
    for title, intro, items in content:
        lines += [f"## {title}", "", intro, ""]
        for it in items:
            if it.cls is not None: lines += _render_class(it)
            else:
                assert it.entry is not None
                e = it.entry
                lines += [f"### {e.qualname.split('.')[-1]}", "", "```python", wrap_call(f"{it.name.rsplit('.', 1)[0]}.{e.signature}"), "```", ""]
                if e.doc: lines += [e.doc, ""]
                elif e.checked: lines += ["*(no docstring)*", ""]
                lines += [f"<sub>{_file(e)}</sub>", ""]
    return "\n".join(line.rstrip() for line in lines).rstrip() + "\n"  # no trailing blanks an editor would strip


def _render_class(it: Item) -> list[str]:
    cd = it.cls
    assert cd is not None
    e = cd.entry
    module = it.name.rsplit(".", 1)[0]
    lines = [f"### {e.qualname}", "", "```python"]
    if cd.constructor: lines.append(wrap_call(f"{module}.{cd.constructor}"))
    else: lines.append(f"class {module}.{e.qualname}" + (f"({', '.join(cd.bases)})" if cd.bases else ""))
    lines += ["```", ""]
    if cd.constructor and cd.bases: lines += [f"Subclass of {', '.join(f'`{b}`' for b in cd.bases)}.", ""]
    lines += [e.doc if e.doc else "*(no docstring)*", "", f"<sub>{_file(e)}</sub>", ""]
    if cd.members:
        lines += [_bullet(m) for m in cd.members]
        lines.append("")
    for names, targets in cd.aliases:
        lines += [f"Aliases: {', '.join(f'`{n}`' for n in names)} are {', '.join(f'`{t}`' for t in targets)}"
                  + (" under the seeds' names (tinygrad's allocator interface)." if names[0].startswith("_") else "."), ""]
    members = [a for a in cd.attributes if a.kind == "member"]
    attrs = [a for a in cd.attributes if a.kind == "attribute"]
    if members:
        lines += ["Members:", ""] + [_bullet(a) for a in members] + [""]
    described = [a for a in attrs if a.doc or " = " in a.signature]
    if described: lines += ["Attributes:", ""] + [_bullet(a) for a in described] + [""]
    if plain := [a for a in attrs if a not in described]:
        lines += [("Other attributes: " if described else "Attributes: ") + ", ".join(f"`{a.signature}`" for a in plain) + ".", ""]
    for base, names in cd.inherited:
        lines += [f"Inherited from [`{base}`](#{_anchor(base)}): {', '.join(f'`{n}`' for n in names)}.", ""]
    if cd.protocols:
        lines += [f"Supports {', '.join(cd.protocols)}.", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=REGEN, description="Generate docs/api.md from the live hcq package.")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is not what would be written")
    mode.add_argument("--stdout", action="store_true", help="print the page instead of writing it")
    args = ap.parse_args(argv)
    page = render()
    if args.stdout:
        sys.stdout.write(page)
        return 0
    if args.check:
        try:
            with open(OUT_PATH, encoding="utf-8") as f: current = f.read()
        except FileNotFoundError:
            current = None
        if current != page:
            print(f"{os.path.relpath(OUT_PATH, ROOT)} is stale; run `{REGEN}`", file=sys.stderr)
            return 1
        return 0
    with open(OUT_PATH, "w", encoding="utf-8") as f: f.write(page)
    print(f"wrote {os.path.relpath(OUT_PATH, ROOT)} ({len(page.encode())} bytes, {page.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
