"""Writing a standalone reproducer of a failed case (:mod:`conformance.reproducers`).

:func:`reproducer_source` assembles the file's text from the case and, read
from the modules the suite itself ran, only the code the case runs
(:func:`conformance.reproducers.sources.written_code`: its model's class, its
API's build in its one config, the loop of its check), each helper it calls once
written at its call (:func:`conformance.reproducers.inline.inlined`), so the file builds
and trains the models exactly as the suite did; :func:`write_reproducer` writes it
under the case id. A case of a rank check other than the lock-step ones
(``averaging``, ``parity``, ``hard_inputs``), or of a hook that is no Python
callable the file could import, has no reproducer: :class:`NoReproducer` says
why.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import os
import re
import sys
import textwrap
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

from conformance.apis.controller_side import controller_side
from conformance.apis.registry import HOOK_APIS
from conformance.models import get_model
from conformance.protocol import Finding, FindingKind
from conformance.reproducers.inline import inlined
from conformance.reproducers.parts import constants_of, early_constants, model_modules, sections, written_code_of
from conformance.reproducers.source_edits import without_blank_lines_in_blocks
from conformance.reproducers.specialise import parsed
from conformance.shared.files import write_atomic
from conformance.catalogue import CHECK_TRAINING

if TYPE_CHECKING:  # pragma: no cover
    from conformance.spec import HookSpec

__all__ = ["NoReproducer", "reproducer_path", "reproducer_source", "write_reproducer"]

#: The rank checks a reproducer replays, with how each trains: the same table the checks' signatures read
#: (:data:`conformance.catalogue.CHECK_TRAINING`, each :class:`~conformance.catalogue.CheckEntry`'s
#: ``training``), so a reproducer trains as the suite did.
CHECK_DEFAULTS = CHECK_TRAINING
#: Parameters of a rank check that are not the case's variant.
_NOT_VARIANT = {"model", "steps", "lr", "examples", "case_id", "fresh", "micro_steps", "reference_only"}


class NoReproducer(Exception):
    """A failed case no standalone file can replay; the message says why (shown in the failure)."""


def _importable(obj: object, modules: Sequence[str]) -> Optional[Tuple[str, str]]:
    """``(module, name)`` that imports ``obj`` itself (``from module import name``), or ``None``: a function or
    class by its qualified name, else any module-level name in ``modules`` bound to it."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and "<" not in qualname and "." not in qualname:
        found = getattr(sys.modules.get(module), qualname, None)
        if found is obj:
            return module, qualname
    for name in modules:
        mod = sys.modules.get(name)
        for attr, value in vars(mod).items() if mod is not None else ():
            if value is obj and not attr.startswith("__"):
                return name, attr
    return None


def imports_the_suite(module_name: str) -> bool:
    """Whether the module ``module_name`` imports ``conformance`` (an ``import`` or ``from ... import`` of it,
    read from its source), or is part of it: then a file that imports the hook from it needs the suite
    installed. ``False`` where its source cannot be read."""
    if module_name == "conformance" or module_name.startswith("conformance."):
        return True
    try:
        tree = parsed(inspect.getsource(importlib.import_module(module_name)))
    except (ImportError, OSError, TypeError, SyntaxError):
        return False
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if any(n == "conformance" or n.startswith("conformance.") for n in names):
            return True
    return False


def needs_the_suite(spec: HookSpec, target: str) -> Optional[str]:
    """Why the reproducer of ``spec`` needs commhook-conformance installed, or ``None`` (it imports only torch and
    the hook's module): the module it imports the hook from imports ``conformance`` (README: keep hooks in a
    module of their own, and their ``HookSpec`` s in another), or the hook has no name to import it by."""
    lines = _hook_imports(spec, target)
    if "_SPECS" in lines:
        return (f"the hook or its state has no name to import it by (a lambda, an object built in the spec), so the "
                f"file takes them from the spec in {target.partition(':')[0]}, which imports conformance")
    modules = sorted({line.split()[1] for line in lines.splitlines() if line.startswith("from ")})
    suite = [m for m in modules if imports_the_suite(m)]
    if suite:
        return (f"the hook's module {suite[0]} imports conformance; keep hooks in a module that imports only "
                f"torch, and their HookSpecs in another (README: Plugging in your hook)")
    return None


def _hook_imports(spec: HookSpec, target: str) -> str:
    """The lines that bind ``HOOK`` and ``STATE``: imported by name from the hook's module where both can be,
    else through the spec's own target (which needs the suite installed, as the comment says)."""
    module = target.partition(":")[0]
    modules = [module, getattr(type(spec.hook), "__module__", module)]
    hook = _importable(spec.hook, modules)
    state = _importable(spec.state, modules) if spec.state is not None else ("", "")
    if hook is not None and state is not None:
        both = f"from {hook[0]} import {hook[1]} as HOOK, {state[1]} as STATE"
        if state[0] == hook[0] and len(both) <= 106:  # one line where it fits, in the file's try
            return both
        lines = [f"from {hook[0]} import {hook[1]} as HOOK"]
        lines.append(f"from {state[0]} import {state[1]} as STATE" if state[0] else "STATE = None")
        return "\n".join(lines)
    attr = target.partition(":")[2]
    return (f"from {module} import {attr} as _SPECS\n"
            f"_SPEC = next(s for s in (_SPECS if isinstance(_SPECS, (list, tuple)) else [_SPECS])\n"
            f"             if s.name == {spec.name!r})\n"
            f"HOOK, STATE = _SPEC.hook, _SPEC.state")


def _head(spec: HookSpec, target: str, imports_of_code: Sequence[str] = ()) -> str:
    """The file's imports: the working directory on the import path (as ``python -m`` puts it), then torch, the
    hook and what the written code imports (``imports_of_code``) inside a ``try`` whose failure exits 2 ("could
    not run"), naming the error, on one rank only."""
    why = needs_the_suite(spec, target)
    hint = ("run this file from the directory the hook's module imports from, or put that on PYTHONPATH"
            if why is None else f"this file needs commhook-conformance installed: {why}")
    imports = "\n".join(f"    {line}" for line in _hook_imports(spec, target).splitlines())
    chunks = textwrap.wrap(hint, 96, drop_whitespace=False)
    hint_literal = "\n".join(("IMPORT_HINT = (" if k == 0 else " " * 15) + repr(c) + (")" if k == len(chunks) - 1 else "")
                             for k, c in enumerate(chunks))
    plain = [line for line in imports_of_code if line.startswith("import ") and " as " not in line and
             not line.split()[1].startswith("torch")]  # the standard library's: one line, outside the try
    imports_of_code = [line for line in imports_of_code if line not in plain]
    return "\n".join([
        "import " + ", ".join(sorted({"os", "sys", *(line.split()[1] for line in plain)})),
        "sys.path.insert(0, os.getcwd())  # as `python -m` does: the suite ran the case from there",
        'os.environ.setdefault("OMP_NUM_THREADS", "1")  # as the suite\'s ranks (and CPU ranks fork: one thread)',
        hint_literal,
        "try:",
        "    import torch",
        *(f"    {line}" for line in imports_of_code),
        imports,
        "except Exception as exc:  # noqa: BLE001 - the case cannot run here: exit 2, naming the error (on one rank)",
        '    if os.environ.get("RANK", "0") == "0":',
        '        print(f"could not run: {type(exc).__name__}: {exc} ({IMPORT_HINT})", flush=True)',
        "    sys.exit(2)",
    ])


def _hex_values(t: torch.Tensor) -> List[str]:
    return [float(v).hex() if v == v and abs(v) != float("inf") else repr(float(v)) for v in t.reshape(-1).tolist()]


def _placed_hex(placed: Dict[str, Any]) -> Dict[str, Any]:
    """A large hard input's description (``standalone_inputs.placed_tensor``) with its placed values as float hex."""
    return {**placed, "values": [float(v).hex() for v in placed["values"]]}


def _failing_step(findings: Sequence[Finding]) -> Optional[int]:
    steps = [f.step for f in findings if f.step is not None]
    return min(steps) if steps else None


def case_literal(spec: HookSpec, rank_check: str, params: Dict[str, Any], world_size: int, case_id: str,
                 findings: Sequence[Finding], nodes: int = 1, backend: str = "gloo") -> Dict[str, Any]:
    """The reproducer's ``CASE``: what the rank check ran, up to the step that failed, on ``backend`` (the
    suite's placement of the case: ``"gloo"`` on CPU ranks, ``"nccl"`` with one GPU a rank).

    Raises:
        NoReproducer: the rank check is none of :data:`CHECK_DEFAULTS`.
    """
    api, _, check = rank_check.partition(".")
    if check not in CHECK_DEFAULTS:
        raise NoReproducer(f"the {check} check is not replayed by a standalone file (only "
                           f"{', '.join(CHECK_DEFAULTS)}); re-run the case with the command below")
    defaults = CHECK_DEFAULTS[check]
    failing = _failing_step(findings)
    steps = int(params.get("steps", defaults["steps"]))
    variant = {k: v for k, v in params.items() if k not in _NOT_VARIANT}
    micro = int(params.get("micro_steps", 1))
    standalone = controller_side(api).standalone
    if not standalone:
        raise NoReproducer(f"api {api!r} has no standalone part (ControllerSide.standalone), so no file can build "
                           "its models without the suite; re-run the case with the command below")
    part = standalone[-1]
    micro = part.micro_steps(variant, micro) if hasattr(part, "micro_steps") else micro
    inputs = None
    if check == "hard_inputs":
        examples = list(params["examples"])
        upto = len(examples) - 1 if failing is None else min(failing if len(examples) > 1 else 0, len(examples) - 1)
        inputs = [[[_placed_hex(t) if isinstance(t, dict) else _hex_values(t) for t in rank] for rank in grads]
                  for _, grads in examples[:upto + 1]]
        steps = len(inputs)
    elif failing is not None:
        steps = min(steps, failing + 1)
    clip = _clip(findings) if check == "clip_grad_norm" else {}
    return {"api": api, "hook": spec.name, "case_id": case_id, "check": check, "world_size": world_size,
            "model": params.get("model", defaults.get("model")), "variant": variant,
            "reduce_dtype": spec.reduce_dtype, "steps": steps, "lr": float(params.get("lr", defaults["lr"])),
            "momentum": defaults["momentum"], "optimizer_step": defaults["optimizer_step"],
            "micro_steps": micro, "inputs": inputs,
            "objective": defaults.get("objective", "model"), "nodes": nodes, "backend": backend,
            **({} if getattr(spec, "param_dtype", None) is None else {"param_dtype": spec.param_dtype}),
            **_native(spec), **clip}


#: How a clip case's findings name the norm type that failed (``total norm (norm_type=inf)``, ``norm_type=2.0``).
_NORM_TYPE = re.compile(r"norm_type=(inf|[0-9.]+)")


def _clip(findings: Sequence[Finding]) -> Dict[str, Any]:
    """``{"clip": {"max_norm": ..., "norm_type": "2.0" or "inf"}}``: the ``clip_grad_norm_`` a clip case's file runs
    after every backward, for the norm type its findings name (the first; 2.0 where none does), as a string
    (``inf`` is no Python literal).

    Raises:
        NoReproducer: the failure is the check's last step, a forward with no backward, which no file replays.
    """
    texts = [f"{f.fqn or ''} {f.message}" for f in findings]
    if any("a forward with no backward" in t for t in texts):
        raise NoReproducer("the clip check's last step (a forward with no backward, then clip_grad_norm_) is not "
                           "replayed by a standalone file; re-run the case with the command below")
    found = next((m.group(1) for m in map(_NORM_TYPE.search, texts) if m), "2.0")
    return {"clip": {"max_norm": CHECK_DEFAULTS["clip_grad_norm"]["clip_max_norm"],
                    "norm_type": "inf" if found == "inf" else str(float(found))}}


def _native(spec: HookSpec) -> Dict[str, Any]:
    """``{"native": mode}`` of a spec meant for one native of its API other than the default
    (``HookSpec.native_modes``: DDP's ``batched_grad_copy``, which every config of such a spec trains with),
    else nothing."""
    modes = getattr(spec, "native_modes", None) or ()
    return {"native": modes[0]} if len(modes) == 1 and modes[0] != "default" else {}


def _rule(title: str) -> str:
    """``# -- title ----...``, 110 characters wide: the heading of a part of the file."""
    head = f"# -- {title} "
    return head + "-" * max(3, 110 - len(head))


def _text(value: object, names: Optional[List[str]] = None) -> str:
    """``value`` as Python: ``repr``; a dtype as ``torch.<name>``; a function or class by its name (added to
    ``names``, which the file must then define); a dataclass instance as its constructor's call with the
    fields that differ from their defaults; dicts and tuples of these."""
    names = [] if names is None else names
    if isinstance(value, torch.dtype):
        return f"torch.{str(value).rsplit('.', 1)[-1]}"
    if inspect.isfunction(value) or inspect.isclass(value):
        names.append(value.__name__)
        return value.__name__
    if dataclasses.is_dataclass(value):
        names.append(type(value).__name__)
        fields = [f for f in dataclasses.fields(value)
                  if f.default is dataclasses.MISSING or getattr(value, f.name) != f.default]
        return f"{type(value).__name__}(" + ", ".join(f"{f.name}={_text(getattr(value, f.name), names)}"
                                                     for f in fields) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_text(k, names)}: {_text(v, names)}" for k, v in value.items()) + "}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_text(v, names) for v in value) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


#: The keys of ``CASE`` a file always writes, read or not: what names the case for its reader.
NAMING_KEYS = ("api", "hook", "check", "world_size", "model", "variant", "reduce_dtype")


def _keys_read(code: Dict[str, List[str]]) -> set:
    """The keys of ``CASE`` the written code reads (``CASE["key"]``, ``CASE.get("key")``)."""
    keys = set()
    for text in (t for texts in code.values() for t in texts):
        for node in ast.walk(parsed(text)):
            if isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "CASE":
                keys.add(getattr(node.slice, "value", None))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    getattr(node.func.value, "id", None) == "CASE" and node.args:
                keys.add(getattr(node.args[0], "value", None))
    return keys


def _literal(case: Dict[str, Any], read: Optional[set] = None, width: int = 110) -> str:
    """``CASE = {...}``: the keys that name the case (:data:`NAMING_KEYS`) and those ``read`` (all where ``None``),
    as many a line as fit in ``width`` columns, the first on the ``CASE = {`` line and the others under it, a long
    value on a line of its own (a hard-input case's ``inputs``); a dtype as ``torch.<name>``."""
    lines: List[str] = []
    for key, value in case.items():
        if read is not None and key not in read and key not in NAMING_KEYS:
            continue
        item = f"{key!r}: {_text(value)},"
        if lines and len(lines[-1]) + 1 + len(item) <= width and len(item) < width // 2:
            lines[-1] += " " + item
        else:
            lines.append(("CASE = {" if not lines else " " * 8) + item)  # the items aligned under the first
    return "\n".join(lines)[:-1] + "}"


def _grouped(texts: Sequence[str]) -> List[str]:
    """``texts`` (definitions, each a text), consecutive assignments joined into one text (no blank line between
    them, as a module writes its constants); a function or class stays a text of its own."""
    out: List[str] = []
    for text in texts:
        is_code = text.startswith(("def ", "class ", "@"))
        if out and not is_code and not out[-1].startswith(("def ", "class ", "@")):
            out[-1] += "\n" + text
        else:
            out.append(text)
    return out


def _filled(text: str) -> str:
    """``text`` as lines of at most 110 columns (a word longer stays whole: a file name)."""
    return textwrap.fill(text, 110, break_long_words=False, break_on_hyphens=False)


def _names_read(texts: Sequence[str]) -> set:
    """Every name ``texts`` (definitions, each parsed alone) read."""
    return {n.id for text in texts for n in ast.walk(parsed(text)) if isinstance(n, ast.Name)}


def _functions(texts: Sequence[str]) -> set:
    """The names of the functions and methods ``texts`` (definitions, each parsed alone) define."""
    out = set()
    for text in texts:
        for node in parsed(text).body:
            members = node.body if isinstance(node, ast.ClassDef) else [node]
            out.update(m.name for m in members if isinstance(m, ast.FunctionDef))
    return out


def reproducer_source(spec: HookSpec, target: str, rank_check: str, params: Dict[str, Any], world_size: int,
                      case_id: str, findings: Sequence[Finding], header: str, rerun: str, path: str,
                      nodes: int = 1, backend: str = "gloo") -> str:
    """The text of the case's reproducer (see :mod:`conformance.reproducers`).

    Args:
        spec: the hook's :class:`~conformance.spec.HookSpec`; ``target``: the ``module:ATTR`` it was loaded from.
        rank_check, params, world_size: what the ranks ran (``<api>.<check>`` and its parameters).
        case_id: the pytest test name; ``findings``: every rank's; ``header``: the failure's first line;
            ``rerun``: the command that re-runs the case in the suite; ``path``: where the file goes (its name is in
            its run command); ``nodes``: the node layout the case simulated (the file sets torchrun's
            variables for it); ``backend``: the process group's backend the suite ran the case on (``"gloo"``:
            CPU ranks; ``"nccl"``: a GPU a rank), which the file runs it on.

    Raises:
        NoReproducer: the case's check is not a lock-step one, or the hook says why it has none (its
            ``no_reproducer`` text: the suite's stand-in for DDP's C++ built-in hooks).
    """
    why = getattr(spec.hook, "no_reproducer", None)
    if isinstance(why, str):
        raise NoReproducer(f"{why}; re-run the case with the command below")
    case = case_literal(spec, rank_check, params, world_size, case_id, findings, nodes=nodes, backend=backend)
    why = needs_the_suite(spec, target)
    imports_line = ("It imports only torch and the hook's module" if why is None else
                    f"It needs commhook-conformance installed: {why}")
    model_cls = get_model(case["model"])
    api = HOOK_APIS[case["api"]]
    standalone = controller_side(api.name).standalone
    constants = constants_of(case, standalone)
    _, code, _ = written_code_of(case, model_cls, standalone, tuple(constants))
    read = _names_read([text for texts in code.values() for text in texts])
    constants = {name: value for name, value in constants.items() if name in read}  # an FSDP2 SETUP folded away
    named: List[str] = []
    constant_lines, late_lines = [], []  # a constant that names the file's definitions comes after them
    for name, value in constants.items():
        before = len(named)
        line = f"{name} = {_text(value, named)}"
        (late_lines if len(named) > before else constant_lines).append(line)
    imports, code, bindings = written_code_of(case, model_cls, standalone, tuple(constants), named)
    early, code = early_constants(model_cls, api, imports, code, [line.split(" = ")[0] for line in constant_lines])
    shown = [f.describe() for f in findings if f.kind is not FindingKind.DIAGNOSIS_NOTE]
    found = "\n".join([f"    {line}" for text in shown[:2] for line in text.splitlines()[:2]]
                      + (["    ..."] if len(shown) > 2 else []))
    file = os.path.basename(path)
    run_it = (f"Run `python {file}` (it starts {world_size} ranks, {backend}) or `torchrun --nproc-per-node {world_size} "
              f"{file}` from the directory the hook's module imports from; `--without-hook` builds both copies "
              "native. Exit status 1: the difference reproduces, 0: it does not, 2: it could not run (the error named).")
    contents = (f"It is what this case runs of the suite's model, {api.name}'s build ({api.installed_with}) and loop "
                f"(commhook-conformance, torch {torch.__version__})"
                + (", with torch and the hook's module as its only imports" if why is None else "")
                + ". Re-run the case in the suite:")
    # one paragraph; where the file needs the suite, the reason on a line of its own between the two
    about = _filled(f"{run_it} {contents}") if why is None else \
        "\n".join([_filled(run_it), f"{imports_line}.", _filled(contents)])
    parts = [  # the docstring, and under it the heading of the file's head
        f'#!/usr/bin/env python3\n"""Standalone reproducer of {case_id}\n\n{header}\n{found}\n\n{about}\n'
        f'    {rerun}\n"""\n'
        + _rule("the hook under test, the case and the file's constants") + "\n" + "\n\n".join(
            [_head(spec, target, imports), "\n".join([_literal(case, _keys_read({**code, "": early})),
                                                      *constant_lines, *early])]),
    ]
    for title, modules in sections(model_cls, api):
        texts = _grouped([text for module in modules for text in code.get(module, [])])
        if texts:
            parts.extend([_rule(title) + "\n" + texts[0], *texts[1:]])  # a heading, then its code
        if model_cls.__module__ in modules:
            parts.append(f"MODEL = {model_cls.__name__}")
    parts.extend(["\n".join([*late_lines, bindings]), 'if __name__ == "__main__":\n    run()'])
    # the model's and the API's helpers, not the loop
    builds = [*model_modules(model_cls), *(m.__name__ for m in standalone)]
    text = "\n\n".join(parts).replace(f"\nMODEL = {model_cls.__name__}\n\n", f"\nMODEL = {model_cls.__name__}\n")
    return without_blank_lines_in_blocks(  # the model's part ends on MODEL, right above the next heading
        inlined(text + "\n", case, _functions([t for m in builds for t in code.get(m, [])])))


def reproducer_path(directory: str, case_id: str) -> str:
    """``directory/<case id>.py``, the brackets of the id and any character a shell would need quoted replaced
    by ``_`` (``test_ddp_parity_h-default-nested_wrapped-ws3.py``)."""
    return os.path.join(directory, re.sub(r"[^A-Za-z0-9_.-]", "_", case_id).strip("_") + ".py")


def write_reproducer(path: str, source: str) -> str:
    """Write ``source`` to ``path`` whole (:func:`conformance.shared.files.write_atomic`), executable; return
    ``path``."""
    return write_atomic(path, source, executable=True)
