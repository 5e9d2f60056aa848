"""Which code a reproducer holds (:mod:`conformance.reproducers`): its parts, in the order a reader meets them.

:func:`written_code_of` reads, from the modules the suite runs (the model's, the
loop's pieces, the API's standalone part), what the case runs
(:func:`conformance.reproducers.sources.written_code`); :func:`sections` names
the parts of the file; :func:`constants_of` collects what the API binds beside
the case (``reproducer_constants``).
"""

from __future__ import annotations

import ast
import builtins
import inspect
from types import ModuleType
from typing import TYPE_CHECKING, Any, Dict, List, Sequence, Tuple

from conformance.apis.controller_side import controller_side
from conformance.reproducers.source_edits import bound_in
from conformance.reproducers.sources import bound_names, written_code
from conformance.reproducers.specialise import parsed, walk
from conformance.shared import standalone_inputs, standalone_main

if TYPE_CHECKING:  # pragma: no cover
    from conformance.apis import HookApi

__all__ = ["PROVIDED", "constants_of", "early_constants", "hoisted_imports", "known_of", "model_modules", "sections",
           "written_code_of"]


#: Names the file binds itself, not read from the suite's modules: its head's imports, the case, the hook,
#: the model, and the two the writer picks per case (:func:`written_code_of`).
PROVIDED = ("os", "sys", "torch", "IMPORT_HINT", "HOOK", "STATE", "CASE", "MODEL", "STEP_INPUTS", "LOSS")


def model_modules(model_cls: type) -> List[str]:
    """The modules of the model's class and of its bases among the suite's models, base class first."""
    out: List[str] = []
    for cls in reversed(model_cls.__mro__):
        if cls.__module__.startswith("conformance.models") and cls.__module__ not in out:
            out.append(cls.__module__)
    return out


def _path(module: str) -> str:
    """A module's file as the repository has it (``models/nested.py``, ``conformance/apis/ddp/standalone.py``)."""
    return module.replace(".", "/").replace("conformance/models/", "models/") + ".py"


def sections(model_cls: type, api: HookApi) -> List[Tuple[str, Sequence[str]]]:
    """``(heading, modules)`` of each part of the file's code, in the order a reader meets them."""
    models = model_modules(model_cls)
    standalone = controller_side(api.name).standalone_modules
    loop = (standalone_main.__name__, *standalone_main.PIECES[:-1])
    return [(f"the model: {model_cls.__name__} ({', '.join(_path(m) for m in models[::-1])}, as the suite builds it)",
             models),
            (f"how the suite builds {api.name}'s models ({', '.join(map(_path, standalone))})", standalone),
            ("the lock-step loop, the comparison and the launcher (conformance/shared/standalone_*.py)", loop)]


def early_constants(model_cls: type, api: HookApi, imports: Sequence[str], code: Dict[str, List[str]],
                    bound: Sequence[str]) -> Tuple[List[str], Dict[str, List[str]]]:
    """``(constants, code)``: the module-level assignments of the API's part and of the loop (what they compare, the
    ``Ranks`` type, ``NATIVE_ONLY``, the exit statuses) that read only what the file binds before its definitions (its
    imports, the head's names, the names ``bound`` beside ``CASE``, the constants taken before them), in the order of
    the file's parts, taken out of ``code`` to be written under ``CASE``: a file's constants in one place, its top.
    One that reads a function or class of the file stays where it is, and so do the model's (its own module's)."""
    available = (set(dir(builtins)) | set(PROVIDED) | set(bound)) - {"MODEL", "STEP_INPUTS", "LOSS"}
    available |= {n for line in imports for n in bound_names(parsed(line).body[0])}
    taken: List[str] = []
    code = {module: list(texts) for module, texts in code.items()}
    for module in [m for _, modules in sections(model_cls, api)[1:] for m in modules]:
        for text in list(code.get(module, [])):
            node = parsed(text).body[0]
            reads = {n.id for n in walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            if isinstance(node, ast.Assign) and reads <= available:
                taken.append(text)
                code[module].remove(text)
                available |= bound_names(node)
    return taken, code


def constants_of(case: Dict[str, Any], standalone: Sequence[ModuleType]) -> Dict[str, Any]:
    """What the API's standalone part (``standalone``, its modules: ``ControllerSide.standalone``) binds beside the
    case (its ``reproducer_constants(case)``: DDP's constructor keywords of the case's config)."""
    out: Dict[str, Any] = {}
    for module in standalone:
        if hasattr(module, "reproducer_constants"):
            out.update(module.reproducer_constants(case))
    return out


def known_of(case: Dict[str, Any], model_cls: type, standalone: Sequence[ModuleType]) -> Dict[str, Dict[str, Any]]:
    """``{module: {name: value}}``: the names of the API's standalone part whose value is the same wherever the
    file's code reads them (its ``reproducer_known(constants, model_cls)``: an FSDP2 file's ``layout``, the
    case's config, and ``cls``, the model class), so an ``if`` on them is written as the branch the case takes
    (:func:`conformance.reproducers.sources.written_code`)."""
    constants = constants_of(case, standalone)
    known: Dict[str, Any] = {}
    for module in standalone:
        if hasattr(module, "reproducer_known"):
            known.update(module.reproducer_known(constants, model_cls))
    return {module.__name__: known for module in standalone} if known else {}


def written_code_of(case: Dict[str, Any], model_cls: type, standalone: Sequence[ModuleType],
                    constants: Sequence[str] = (),
                    constants_read: Sequence[str] = ()) -> Tuple[List[str], Dict[str, List[str]], str]:
    """``(imports, code by module, bindings)``: of the model's modules, the loop's pieces and the API's
    standalone part, only what the case runs (:func:`conformance.reproducers.sources.written_code`, from
    ``run``, the model's class and the case's way of making inputs; an ``if`` on the part's known names as
    the branch the case takes, :func:`known_of`; a function's own imports made at the head, :func:`hoisted_imports`),
    and the line that binds ``STEP_INPUTS`` and ``LOSS``."""
    step_inputs = standalone_inputs.step_inputs_of(case)
    loss = standalone_inputs.loss_of(case)
    roots = ["run", model_cls.__name__, step_inputs, *([] if loss.startswith("MODEL.") else [loss]), *constants_read]
    modules = [*model_modules(model_cls), *standalone_main.PIECES, *(m.__name__ for m in standalone)]
    prune = [c for c in model_cls.__mro__ if c.__module__.startswith("conformance.models")]
    prune += [c for m in standalone for c in vars(m).values() if inspect.isclass(c) and c.__module__ == m.__name__]
    imports, code = written_code(roots, modules, provided=(*PROVIDED, *constants), model=model_cls, prune=prune,
                                 also_reads=f"{step_inputs}, {loss}", case=case,
                                 known=known_of(case, model_cls, standalone))
    return (*hoisted_imports(_merged(imports), code), f"STEP_INPUTS, LOSS = {step_inputs}, {loss}")


def hoisted_imports(imports: Sequence[str], code: Dict[str, List[str]]) -> Tuple[List[str], Dict[str, List[str]]]:
    """``(imports, code)`` with each one-line import that a written function makes as a statement of its body
    (``from torch.distributed.fsdp import FullyShardedDataParallel as FSDP`` in ``ReferenceModel.build_fsdp``, which
    keeps the suite's models importable without ``torch.distributed``) moved to the file's head, beside its other
    imports (in the ``try`` whose failure is "could not run"): the file runs its case, which needs it anyway. Left
    in place where a name it binds is bound otherwise in the file or in the function."""
    imports = list(imports)
    bound = {n for line in imports for n in bound_names(parsed(line).body[0])}
    bound |= {n for texts in code.values() for text in texts for node in parsed(text).body
              for n in bound_names(node)}
    out: Dict[str, List[str]] = {}
    for module, texts in code.items():
        out[module] = []
        for text in texts:
            lines = text.splitlines()
            functions = [f for node in parsed(text).body
                         for f in ([node] if isinstance(node, ast.FunctionDef) else getattr(node, "body", []))
                         if isinstance(f, ast.FunctionDef)]
            for function in functions:
                rest = [s for s in function.body if not isinstance(s, (ast.Import, ast.ImportFrom))]
                stored = bound_in(ast.Module(body=rest, type_ignores=[])) | \
                    {a.arg for a in walk(function.args) if isinstance(a, ast.arg)}
                for stmt in function.body[:-1]:
                    if not isinstance(stmt, (ast.Import, ast.ImportFrom)) or getattr(stmt, "level", 0) or \
                            stmt.lineno != stmt.end_lineno:
                        continue
                    line = ast.unparse(stmt)
                    names = bound_names(stmt)
                    if names & stored or (names & bound and line not in imports):
                        continue
                    lines[stmt.lineno - 1] = None  # type: ignore[call-overload]
                    if line not in imports:
                        imports.append(line)
                        bound |= names
            out[module].append("\n".join(line for line in lines if line is not None))
    return _merged(imports), out


def _merged(imports: Sequence[str]) -> List[str]:
    """``import`` lines as written, and one ``from X import ...`` line per module ``X``, in first-seen order."""
    out: List[str] = []
    froms: Dict[str, List[str]] = {}
    for line in imports:
        if line.startswith("from "):
            module, _, names = line[5:].partition(" import ")
            if module not in froms:
                froms[module] = []
                out.append(module)
            froms[module].extend(names.split(", "))
        else:
            out.append(line)
    lines = [f"from {line} import {', '.join(sorted(froms[line]))}" if line in froms else line for line in out]
    return sorted(lines, key=lambda line: (line.split()[1].startswith("torch"), line.startswith("from"),
                                           line.split()[1]))
