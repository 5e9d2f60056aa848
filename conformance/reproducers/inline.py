"""A written reproducer's single-use helpers inlined where its case calls them, and what that leaves unread removed.

The file's code is the suite's (:mod:`conformance.reproducers.sources`), and the suite
reaches its model and its build through small helpers that serve every config and model
(``subgroup(ranks)`` that returns ``ranks`` outside the subgroup configs, ``mesh_shape``,
``bind_comm``, a model's ``_world_size``). Where the file calls such a helper once, and the
helper is one ``return`` of one line, :func:`inlined` writes the expression at the call, its
parameters replaced by the call's arguments, and drops the helper; an ``x if <CASE test> else
y`` the case decides is written as its branch. What no code reads any more (the helper, an
import) goes too. The file runs the same calls as before, in the same order: an argument is
written in place of its parameter only where the parameter is read once (outside a ``lambda``
or a comprehension) or the argument is a name, a constant or a field read, and an argument
the helper does not read is dropped only where it is one of those.

Raises nothing: a call that does not fit these rules is left as written.
"""

from __future__ import annotations

import ast
from typing import Any, Dict, List, Optional, Set, Tuple

from conformance.reproducers.specialise import _case_constant

__all__ = ["inlined"]

#: Lines a replacement may make: the width of the file's headings (a longer line is read less easily than the call).
WIDTH = 110
#: Names the file binds itself (its head), never removed as unread.
_KEPT = {"os", "sys", "torch", "HOOK", "STATE", "IMPORT_HINT", "CASE", "MODEL"}
#: The names the writer binds per case to what the loop calls (the inputs of a step, the loss): written in place.
ALIASES = {"STEP_INPUTS", "LOSS"}
#: An expression that needs no parentheses wherever it is written.
_ATOMIC = (ast.Name, ast.Constant, ast.Attribute, ast.Call, ast.Subscript, ast.List, ast.Dict, ast.Set,
           ast.ListComp, ast.DictComp, ast.SetComp, ast.GeneratorExp, ast.JoinedStr)


def _atomic(node: ast.expr, text: str) -> bool:
    return isinstance(node, _ATOMIC) or (isinstance(node, ast.Tuple) and text.startswith("("))


def _simple(node: ast.expr) -> bool:
    """A name, a constant, or a field or constant-index read of one: no call, the same value read twice."""
    if isinstance(node, (ast.Name, ast.Constant)):
        return True
    if isinstance(node, ast.Attribute):
        return _simple(node.value)
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and _simple(node.value)


class _Helper:
    """A function of one ``return`` of one line: top-level, or a private method (first parameter the receiver)."""

    def __init__(self, node: ast.FunctionDef, owner: Optional[str]):
        self.node, self.owner, self.name = node, owner, node.name
        decorators = [getattr(d, "id", None) for d in node.decorator_list]
        self.static = decorators == ["staticmethod"]
        self.expr: ast.expr = node.body[0].value  # type: ignore[attr-defined]

    @staticmethod
    def of(node: ast.stmt, owner: Optional[str]) -> Optional["_Helper"]:
        if not isinstance(node, ast.FunctionDef) or len(node.body) != 1 or \
                not isinstance(node.body[0], ast.Return) or node.body[0].value is None:
            return None
        value = node.body[0].value
        if node.args.vararg or node.args.kwarg:
            return None
        if owner is not None:
            decorators = [getattr(d, "id", None) for d in node.decorator_list]
            if not node.name.startswith("_") or node.name.startswith("__") or \
                    decorators not in ([], ["classmethod"], ["staticmethod"]):
                return None
        elif node.decorator_list:
            return None
        return _Helper(node, owner)

    def params(self) -> Tuple[List[ast.arg], List[Optional[ast.expr]]]:
        """The parameters a call binds (a method's receiver first), with their defaults."""
        args = self.node.args
        positional = args.posonlyargs + args.args
        defaults: List[Optional[ast.expr]] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
        return positional + args.kwonlyargs, defaults + list(args.kw_defaults)


def _parents(tree: ast.AST) -> Dict[int, ast.AST]:
    return {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _bound_in(function: Optional[ast.AST]) -> Set[str]:
    """The names a function binds itself (its parameters, what it assigns): the caller's locals."""
    if function is None:
        return set()
    names = {a.arg for a in ast.walk(function) if isinstance(a, ast.arg)}
    return names | {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}


def _helpers(tree: ast.Module) -> Dict[str, List[_Helper]]:
    """Every function of the file by name (a method's under its name too), the one-``return`` ones as helpers;
    a name defined twice maps to a list of two (never inlined)."""
    out: Dict[str, List[Any]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.setdefault(member.name, []).append(_Helper.of(member, node.name))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.setdefault(node.name, []).append(_Helper.of(node, None))
    return out


def _uses(tree: ast.Module) -> Dict[str, List[ast.AST]]:
    """Where each name is read: a ``Name`` loaded, or an attribute of that name."""
    out: Dict[str, List[ast.AST]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            out.setdefault(node.id, []).append(node)
        elif isinstance(node, ast.Attribute):
            out.setdefault(node.attr, []).append(node)
    return out


def _replacement(helper: _Helper, call: ast.Call, source: str, caller_locals: Set[str],
                 case: Dict[str, Any]) -> Optional[str]:
    """The helper's expression for ``call`` (one line, once the case's branch of each ``x if <CASE test> else y``
    is kept), or ``None`` where the rules of the module do not allow it."""
    params, defaults = helper.params()
    bound: Dict[str, ast.expr] = {}
    given = list(call.args)
    if helper.owner is not None and not helper.static:
        if not isinstance(call.func, ast.Attribute):
            return None
        given.insert(0, call.func.value)
    if any(isinstance(a, ast.Starred) for a in given) or any(k.arg is None for k in call.keywords):
        return None
    positional = params[:len(helper.node.args.posonlyargs + helper.node.args.args)]
    if len(given) > len(positional):
        return None
    for param, arg in zip(positional, given):
        bound[param.arg] = arg
    for keyword in call.keywords:
        if keyword.arg in bound or keyword.arg not in {p.arg for p in params}:
            return None
        bound[keyword.arg] = keyword.value  # type: ignore[index]
    for param, default in zip(params, defaults):
        if param.arg not in bound:
            if default is None:
                return None
            bound[param.arg] = default
    expr = helper.expr
    expr_source = ast.get_source_segment(source, expr) or ""
    local_scopes = [n for n in ast.walk(expr) if isinstance(n, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
                                                                  ast.GeneratorExp))]
    in_scope = {id(n) for scope in local_scopes for n in ast.walk(scope)}
    reads: Dict[str, List[ast.Name]] = {}
    for node in ast.walk(expr):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            reads.setdefault(node.id, []).append(node)
    inner = _bound_in(ast.Module(body=[ast.Expr(s) for s in local_scopes], type_ignores=[]))
    if any(name not in bound and name not in inner and name in caller_locals for name in reads):
        return None  # the helper reads a global the caller's local would hide
    texts: Dict[str, str] = {}
    for name, arg in bound.items():
        text = ast.get_source_segment(source, arg) if arg is not None else None
        if text is None or "\n" in text:
            return None
        uses = reads.get(name, [])
        if not _simple(arg) and (len(uses) != 1 or id(uses[0]) in in_scope):
            return None
        texts[name] = text if _atomic(arg, text) else f"({text})"
    lines = source.splitlines()
    starts = [0]  # where each line of the expression starts in its text
    for number in range(expr.lineno, expr.end_lineno or expr.lineno):
        starts.append(starts[-1] + len(lines[number - 1]) + 1 - (expr.col_offset if number == expr.lineno else 0))

    def at(lineno: int, col: int) -> int:
        return starts[lineno - expr.lineno] + col - (expr.col_offset if lineno == expr.lineno else 0)

    pieces = sorted(((at(n.lineno, n.col_offset), at(n.end_lineno or n.lineno, n.end_col_offset or 0), texts[n.id])
                     for name in bound for n in reads.get(name, [])), reverse=True)
    for start, end, text in pieces:
        expr_source = expr_source[:start] + text + expr_source[end:]
    if "\n" in expr_source:  # a conditional the case decides may leave one line
        folded = _fold_case_branches(f"_ = (\n{expr_source}\n)\n", case)
        value = ast.parse(folded).body[0].value  # type: ignore[attr-defined]
        expr_source = ast.get_source_segment(folded, value) or ""
        if "\n" in expr_source:
            return None
    return expr_source


def _cut(lines: List[str], node: ast.AST, text: str) -> List[str]:
    l0, c0, l1, c1 = node.lineno, node.col_offset, node.end_lineno, node.end_col_offset  # type: ignore[attr-defined]
    return lines[:l0 - 1] + [lines[l0 - 1][:c0] + text + lines[l1 - 1][c1:]] + lines[l1:]


def _inline_one(source: str, case: Dict[str, Any]) -> Optional[Tuple[str, str]]:
    """``(source with one helper inlined, the helper's name)``, or ``None`` where none is left."""
    tree = ast.parse(source)
    parents = _parents(tree)
    uses = _uses(tree)
    for name, helpers in _helpers(tree).items():
        if len(helpers) != 1 or helpers[0] is None or len(uses.get(name, [])) != 1:
            continue
        helper, use = helpers[0], uses[name][0]
        is_method = helper.owner is not None
        if is_method != isinstance(use, ast.Attribute):
            continue
        call = parents.get(id(use))
        if not isinstance(call, ast.Call) or call.func is not use:
            continue
        caller = call
        while caller is not None and not isinstance(caller, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            caller = parents.get(id(caller))
        if caller is helper.node:
            continue  # recursive
        text = _replacement(helper, call, source, _bound_in(caller), case)
        if text is None:
            continue
        parent = parents.get(id(call))
        alone = isinstance(parent, (ast.Assign, ast.Return, ast.Expr, ast.keyword, ast.Call, ast.List, ast.AnnAssign))
        if not alone and not _atomic(helper.expr, text):
            text = f"({text})"
        lines = _cut(source.splitlines(), call, text)
        if any(len(line) > WIDTH for line in lines[call.lineno - 1:call.lineno]):
            continue
        return "\n".join(lines) + "\n", name
    return None


def _statement_body(node: ast.FunctionDef) -> Optional[List[ast.stmt]]:
    """The statements of a function whose one ``return`` (if any) is its last statement, none a ``yield``,
    ``global`` or ``nonlocal``; ``None`` otherwise."""
    def own(n: ast.AST):  # the nodes of the function's own scope
        for child in ast.iter_child_nodes(n):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                yield child
                yield from own(child)

    body = node.body
    returns = [n for stmt in body for n in [stmt, *own(stmt)] if isinstance(n, ast.Return)]
    if any(isinstance(n, (ast.Yield, ast.YieldFrom, ast.Global, ast.Nonlocal, ast.Await))
           for stmt in body for n in [stmt, *own(stmt)]):
        return None
    if returns and (len(returns) > 1 or returns[0] is not body[-1]):
        return None
    return body


def _inline_statement(source: str, names: Set[str]) -> Optional[Tuple[str, str]]:
    """``(source with one single-use helper of ``names`` written in place of the statement that calls it, the
    helper's name)``, or ``None``: a call that is a whole statement (``x = f(...)``, ``f(...)``, ``return f(...)``)
    of a function, to a function whose one ``return`` ends it. Each parameter whose argument is another
    expression than a name, a constant or a field read, or that the helper assigns, is assigned first."""
    tree = ast.parse(source)
    parents = _parents(tree)
    uses = _uses(tree)
    lines = source.splitlines()
    defined: Dict[str, List[Tuple[ast.FunctionDef, Optional[str]]]] = {}
    for node in tree.body:
        members = [(m, node.name) for m in node.body] if isinstance(node, ast.ClassDef) else [(node, None)]
        for member, owner in members:
            if isinstance(member, ast.FunctionDef):
                defined.setdefault(member.name, []).append((member, owner))
    for name in sorted(names):
        if len(defined.get(name, [])) != 1 or len(uses.get(name, [])) != 1:
            continue
        node, owner = defined[name][0]
        use = uses[name][0]
        decorators = [getattr(d, "id", None) for d in node.decorator_list]
        if (owner is None) == isinstance(use, ast.Attribute) or \
                decorators not in (([],) if owner is None else ([], ["classmethod"], ["staticmethod"])):
            continue
        body = _statement_body(node)
        call = parents.get(id(use))
        if body is None or not isinstance(call, ast.Call) or call.func is not use or node.args.vararg or \
                node.args.kwarg:
            continue
        statement = parents.get(id(call))
        target: Optional[str] = None
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1 and \
                isinstance(statement.targets[0], ast.Name):
            target = statement.targets[0].id
        elif not isinstance(statement, (ast.Expr, ast.Return)):
            continue
        caller = statement
        while caller is not None and not isinstance(caller, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            caller = parents.get(id(caller))
        caller_owner = next((c.name for c in tree.body if isinstance(c, ast.ClassDef) and caller in c.body), None)
        if not isinstance(caller, ast.FunctionDef) or caller is node or caller_owner != owner:
            continue  # a method stays in its class: only its own class's methods take it in
        params = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
        positional = node.args.posonlyargs + node.args.args
        given = list(call.args)
        if owner is not None and decorators != ["staticmethod"]:
            given.insert(0, call.func.value)  # type: ignore[attr-defined]
        if any(isinstance(a, ast.Starred) for a in given) or any(k.arg is None for k in call.keywords) or \
                len(given) > len(positional):
            continue
        bound: Dict[str, Optional[ast.expr]] = {p.arg: a for p, a in zip(positional, given)}
        for keyword in call.keywords:
            bound[keyword.arg] = keyword.value  # type: ignore[index]
        defaults = [None] * (len(positional) - len(node.args.defaults)) + list(node.args.defaults) + \
            list(node.args.kw_defaults)
        for param, default in zip(params, defaults):
            bound.setdefault(param.arg, default)
        if any(v is None for v in bound.values()) or set(bound) != {p.arg for p in params}:
            continue
        assigned = _bound_in(ast.Module(body=body, type_ignores=[])) - {a.arg for a in ast.walk(
            ast.Module(body=body, type_ignores=[])) if isinstance(a, ast.arg)}
        caller_names = {n.id for n in ast.walk(caller) if isinstance(n, ast.Name)} | \
            {a.arg for a in ast.walk(caller) if isinstance(a, ast.arg)}
        arg_names = {n.id for a in bound.values() for n in ast.walk(a) if isinstance(n, ast.Name)}  # type: ignore
        texts = {p: ast.get_source_segment(source, a) for p, a in bound.items()}  # type: ignore[arg-type]
        first: List[str] = []
        replace: Dict[str, str] = {}
        for param, arg in bound.items():
            text = texts[param] or ""
            if text == param:
                if param in assigned and param != target:
                    break  # the helper would change the caller's own variable
                continue
            if _simple(arg) and param not in assigned and "\n" not in text:  # type: ignore[arg-type]
                replace[param] = text
            else:
                first.append(f"{param} = {text}")
        else:
            locals_ = (assigned | {l.split(" = ")[0] for l in first}) - {target}
            scoped = {a.arg for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.Lambda)
                      for a in ast.walk(n.args) if isinstance(a, ast.arg)}
            scoped |= {t.id for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.comprehension)
                       for t in ast.walk(n.target) if isinstance(t, ast.Name)}
            reads = {n.id for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.Name)} - scoped
            if locals_ & caller_names or (target in arg_names and target in assigned) or \
                    (reads - set(bound) - assigned) & (_bound_in(caller) - arg_names - {target}):
                continue
            indent = lines[statement.lineno - 1][:statement.col_offset]
            start, end = body[0].lineno, (body[-1].end_lineno or body[-1].lineno)
            body_indent = len(lines[start - 1]) - len(lines[start - 1].lstrip())
            if any(line.strip() and len(line) - len(line.lstrip()) < body_indent for line in lines[start - 1:end]):
                continue  # a line the dedent would cut (a string's continuation)
            region = ast.parse("\n".join(line[body_indent:] if line.strip() else line
                                         for line in lines[start - 1:end]))
            text_lines = [line[body_indent:] if line.strip() else "" for line in lines[start - 1:end]]
            edits = [(n.lineno, n.col_offset, n.end_col_offset, replace[n.id]) for n in ast.walk(region)
                     if isinstance(n, ast.Name) and n.id in replace]
            for lineno, c0, c1, text in sorted(edits, reverse=True):
                text_lines[lineno - 1] = text_lines[lineno - 1][:c0] + text + text_lines[lineno - 1][c1:]
            last = region.body[-1]
            if isinstance(last, ast.Return):
                value = "\n".join(text_lines[last.lineno - 1:last.end_lineno])[last.col_offset + 7:] \
                    if last.value is not None else "None"
                del text_lines[last.lineno - 1:]
                if isinstance(statement, ast.Return):
                    text_lines.append(f"return {value}")
                elif isinstance(statement, ast.Expr) and last.value is not None and not _simple(last.value):
                    text_lines.append(value)  # a call's value the caller drops: the call still runs
                elif target is not None and value != target:
                    text_lines.append(f"{target} = {value}")
            elif not isinstance(statement, ast.Expr):
                continue
            new = [indent + line if line else "" for line in first + text_lines]
            if any(len(line) > 120 for line in new):
                continue
            out = lines[:statement.lineno - 1] + new + lines[(statement.end_lineno or statement.lineno):]
            return "\n".join(out) + "\n", name
    return None


def _fold_case_branches(source: str, case: Dict[str, Any]) -> str:
    """``x if <test> else y`` whose test reads only ``CASE`` (and constants) written as its branch."""
    while True:
        tree = ast.parse(source)
        found = next(((n, v) for n in ast.walk(tree) if isinstance(n, ast.IfExp)
                      for v in [_case_constant(n.test, case, {})] if v is not None), None)
        if found is None:
            return source
        node, value = found
        kept = ast.get_source_segment(source, node.body if value else node.orelse) or "None"
        source = "\n".join(_cut(source.splitlines(), node, kept)) + "\n"


def _removed(source: str, names: Set[str], members: Set[str]) -> Tuple[str, Set[str]]:
    """``source`` less the top-level definitions (functions, classes, one-name assignments) and imported names of
    ``names``, and the methods of ``members``, that nothing reads any more; with the names the removed
    definitions read (candidates in their turn)."""
    tree = ast.parse(source)
    uses = _uses(tree)
    lines = source.splitlines()
    edits: List[Tuple[int, int, List[str]]] = []  # (first line, last line, what replaces them)
    freed: Set[str] = set()

    def unread(name: str, among: Set[str]) -> bool:
        return name in among and name not in _KEPT and not uses.get(name)

    def visit(body: List[ast.stmt], among: Set[str]) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, members)
            elif isinstance(node, ast.Try):
                visit(node.body, among)
            bound = None
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound = node.name
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                bound = node.targets[0].id
            if bound is not None and unread(bound, among):
                start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
                end = node.end_lineno or start
                if end < len(lines) and not lines[end].strip() and (start < 2 or not lines[start - 2].strip()):
                    end += 1  # the blank line that set it apart
                edits.append((start, end, []))
                freed.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                kept = [a for a in node.names if not unread((a.asname or a.name).split(".")[0], names)]
                if len(kept) < len(node.names):
                    text = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in kept)
                    head = "import " if isinstance(node, ast.Import) else f"from {node.module} import "
                    indent = lines[node.lineno - 1][:node.col_offset]
                    edits.append((node.lineno, node.end_lineno or node.lineno, [indent + head + text] if kept else []))

    visit(tree.body, names)
    for start, end, text in sorted(edits, reverse=True):
        lines[start - 1:end] = text
    return "\n".join(lines) + "\n", freed


def _without_empty_kwargs(source: str) -> str:
    """``source`` less each name bound once to ``{}`` and read only as ``**name`` in a call (what a case that claims
    no reduce dtype leaves of ``kwargs = mixed_precision(...)``, ``root_extra = cls._root_fsdp_kwargs(...)``):
    the binding and each ``, **name`` go."""
    while True:
        tree = ast.parse(source)
        found = None
        for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))]:
            own = [n for stmt in scope.body for n in ast.walk(stmt)]
            for stmt in scope.body:
                if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and
                        isinstance(stmt.targets[0], ast.Name) and isinstance(stmt.value, ast.Dict) and
                        not stmt.value.keys):
                    continue
                name = stmt.targets[0].id
                names = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == name]
                spread = [(call, k) for call in ast.walk(tree) if isinstance(call, ast.Call)
                          for k, kw in enumerate(call.keywords)
                          if kw.arg is None and isinstance(kw.value, ast.Name) and kw.value.id == name]
                stores = [n for n in names if not isinstance(n.ctx, ast.Load)]
                if len(stores) == 1 and stores[0] in own and spread and len(names) == 1 + len(spread) and \
                        all(k or call.args for call, k in spread):
                    found = (stmt, spread)
                    break
            if found:
                break
        if found is None:
            return source
        stmt, spread = found
        lines = source.splitlines()
        for call, k in sorted(spread, key=lambda s: (s[0].keywords[s[1]].lineno, s[0].keywords[s[1]].col_offset),
                              reverse=True):
            keyword = call.keywords[k]
            previous = call.keywords[k - 1] if k else max(call.args, key=lambda a: (a.end_lineno, a.end_col_offset))
            if previous.end_lineno != keyword.end_lineno:
                return source
            line = lines[keyword.end_lineno - 1]
            lines[keyword.end_lineno - 1] = line[:previous.end_col_offset] + line[keyword.end_col_offset:]
        del lines[stmt.lineno - 1:stmt.end_lineno]
        source = "\n".join(lines) + "\n"


def _without_aliases(source: str) -> str:
    """``source`` with the writer's per-case names (``STEP_INPUTS, LOSS = model_inputs, MODEL.loss``: :data:`ALIASES`)
    written where the loop reads them, and their binding left out."""
    tree = ast.parse(source)
    binding = next((n for n in tree.body if isinstance(n, ast.Assign) and len(n.targets) == 1 and
                    isinstance(n.targets[0], ast.Tuple) and isinstance(n.value, ast.Tuple) and
                    {getattr(t, "id", None) for t in n.targets[0].elts} <= ALIASES), None)
    if binding is None or not all(isinstance(v, (ast.Name, ast.Attribute)) for v in binding.value.elts):
        return source
    texts = {t.id: ast.get_source_segment(source, v)  # type: ignore[attr-defined]
             for t, v in zip(binding.targets[0].elts, binding.value.elts)}  # type: ignore[attr-defined]
    reads = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in texts]
    lines = source.splitlines()
    for node in sorted(reads, key=lambda n: (n.lineno, n.col_offset), reverse=True):
        lines = _cut(lines, node, texts[node.id] or node.id)
    end = binding.end_lineno or binding.lineno
    if end < len(lines) and not lines[end].strip():
        end += 1
    del lines[binding.lineno - 1:end]
    return "\n".join(lines) + "\n"


def inlined(source: str, case: Dict[str, Any], statements: Set[str] = frozenset()) -> str:
    """``source`` (a written reproducer) with its single-use one-line helpers inlined (see the module), the case's
    branch of each ``x if <CASE test> else y`` kept, the writer's per-case names written where they are read, and
    what no code reads any more removed."""
    source = _without_aliases(source)
    inlined_names: Set[str] = set()
    while True:
        step = _inline_one(source, case) or _inline_statement(source, set(statements))
        if step is None:
            break
        source, name = step
        inlined_names.add(name)
        source, _ = _removed(source, {name}, {name})  # its definition, read nowhere now: its calls count no more
    source = _without_empty_kwargs(_fold_case_branches(source, case))
    candidates = inlined_names | {(a.asname or a.name).split(".")[0] for n in ast.walk(ast.parse(source))
                                  if isinstance(n, (ast.Import, ast.ImportFrom)) and
                                  getattr(n, "module", None) != "__future__" for a in n.names}
    while candidates:
        source, freed = _removed(source, candidates, inlined_names)
        candidates = freed - inlined_names
    return source
