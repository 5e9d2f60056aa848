"""A written reproducer's single-use helpers inlined where its case calls them, and what that leaves unread removed.

The file's code is the suite's (:mod:`conformance.reproducers.sources`), and the suite
reaches its model and its build through small helpers that serve every config and model
(``subgroup(ranks)`` that returns ``ranks`` outside the subgroup configs, ``mesh_shape``,
``bind_comm``, a model's ``_world_size``, FSDP2's ``wrap_model``). Where the file calls such a
helper once, :func:`inlined` writes it at the call and drops its definition:

- a helper that is one ``return`` (of one line, once the case's branch of each ``x if <CASE test>
  else y`` is kept, or of lines aligned under its first where the call is an assignment's or a
  ``return``'s whole value: ``model_inputs``) as that expression, its parameters replaced by the
  call's arguments;
- a helper of the model's or the API's build (never the loop's: its functions are what the file is
  read by) whose one ``return`` ends it, called as a whole statement (``x = f(...)``, ``f(...)``,
  ``return f(...)``) from a function of its own class or, for a module-level one, of the module, as
  its statements in place of that statement; a parameter whose argument is another expression, or
  that the helper assigns, is assigned first.

The file runs the same calls as before, in the same order: an argument is written in place of its
parameter only where the parameter is read once (outside a ``lambda`` or a comprehension) or the
argument is a name, a constant or a field read; an argument the helper does not read is dropped only
where it is one of those; a helper is not written where one of its names would meet a caller's
variable. Then a local lambda is written where it is read, and what no code reads any more goes
(:mod:`conformance.reproducers.source_edits`).

Raises nothing: a call that does not fit these rules is left as written.
"""

from __future__ import annotations

import ast
from typing import Any, Dict, List, Optional, Set, Tuple

from conformance.reproducers.source_edits import (atomic, bound_in, cut, fold_case_branches, removed,
                                                  removed_after_inlining, simple, uses_of, without_aliases,
                                                  without_empty_kwargs, without_local_lambdas)
from conformance.reproducers.specialise import parents
from conformance.reproducers.specialise import parsed, segment, walk

__all__ = ["inlined"]

#: Lines a replacement may make: the width of the file's headings (a longer line is read less easily than the call).
WIDTH = 110


class _Helper:
    """A function of one ``return``: top-level, or a private method (its first parameter the receiver, but for a
    ``staticmethod``)."""

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
    expr_source = segment(source, expr) or ""
    local_scopes = [n for n in walk(expr) if isinstance(n, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
                                                                  ast.GeneratorExp))]
    in_scope = {id(n) for scope in local_scopes for n in walk(scope)}
    reads: Dict[str, List[ast.Name]] = {}
    for node in walk(expr):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            reads.setdefault(node.id, []).append(node)
    inner = bound_in(ast.Module(body=[ast.Expr(s) for s in local_scopes], type_ignores=[]))
    if any(name not in bound and name not in inner and name in caller_locals for name in reads):
        return None  # the helper reads a global the caller's local would hide
    texts: Dict[str, str] = {}
    for name, arg in bound.items():
        text = segment(source, arg) if arg is not None else None
        if text is None or "\n" in text:
            return None
        uses = reads.get(name, [])
        if not simple(arg) and (len(uses) != 1 or id(uses[0]) in in_scope):
            return None
        texts[name] = text if atomic(arg, text) else f"({text})"
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
        folded = fold_case_branches(f"_ = (\n{expr_source}\n)\n", case)
        value = parsed(folded).body[0].value  # type: ignore[attr-defined]
        expr_source = segment(folded, value) or ""
    if "\n" in expr_source:  # lines aligned under its first move with it, to the call's column (_inline_one)
        shift = call.col_offset - expr.col_offset
        head, *rest = expr_source.split("\n")
        if any(len(line) - len(line.lstrip()) <= expr.col_offset for line in rest):
            return None  # a hanging indent, which the call's line would not read as its own
        expr_source = "\n".join([head, *(" " * shift + line if shift > 0 else line[-shift:] for line in rest)])
    return expr_source


def _own_method(tree: ast.Module, use: ast.Attribute, caller: Optional[ast.AST], owner: Optional[str]) -> bool:
    """Whether ``self.name`` / ``cls.name`` (``use``) read in ``caller`` is the method of class ``owner``: the caller
    is a method of ``owner``, of a class ``owner`` derives from, or of one derived from ``owner`` (the file's own
    classes, by their bases' names), and it reads the method on its own ``self`` or ``cls``."""
    if not (isinstance(use.value, ast.Name) and use.value.id in ("self", "cls")):
        return False
    bases = {c.name: {getattr(b, "id", None) for b in c.bases} for c in tree.body if isinstance(c, ast.ClassDef)}
    home = next((c.name for c in tree.body if isinstance(c, ast.ClassDef) and caller in c.body), None)

    def above(name: Optional[str]) -> Set[str]:
        out: Set[str] = set()
        while name in bases and name not in out:
            out.add(name)  # type: ignore[arg-type]
            name = next((b for b in bases[name] if b in bases), None)  # type: ignore[index]
        return out

    return home is not None and (owner in above(home) or home in above(owner))


def _inline_one(source: str, case: Dict[str, Any]) -> Optional[Tuple[str, str]]:
    """``(source with one helper inlined and its definition, read nowhere now, left out; the helper's name)``, or
    ``None`` where none is left."""
    tree = parsed(source)
    parent_of = parents(tree)
    uses = uses_of(tree)
    for name, helpers in _helpers(tree).items():
        if len(helpers) != 1 or helpers[0] is None or len(uses.get(name, [])) != 1:
            continue
        helper, use = helpers[0], uses[name][0]
        is_method = helper.owner is not None
        if is_method != isinstance(use, ast.Attribute):
            continue
        call = parent_of.get(id(use))
        if not isinstance(call, ast.Call) or call.func is not use:
            continue
        caller = call
        while caller is not None and not isinstance(caller, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            caller = parent_of.get(id(caller))
        if caller is helper.node or (is_method and not _own_method(tree, use, caller, helper.owner)):
            continue  # recursive, or a method another object's may be
        text = _replacement(helper, call, source, bound_in(caller), case)
        if text is None:
            continue
        parent = parent_of.get(id(call))
        alone = isinstance(parent, (ast.Assign, ast.Return, ast.Expr, ast.keyword, ast.Call, ast.List, ast.AnnAssign)) \
            and not (isinstance(parent, ast.Call) and parent.func is call)
        if not alone and not atomic(helper.expr, text):
            text = f"({text})"
        if "\n" in text and not (isinstance(parent, (ast.Assign, ast.Return)) and parent.value is call):
            continue  # an expression of several lines: only as a statement's whole value
        lines = "\n".join(cut(source.splitlines(), call, text)).split("\n")
        if any(len(line) > WIDTH for line in lines[call.lineno - 1:call.lineno + text.count("\n")]):
            continue
        edited = "\n".join(lines) + "\n"
        fast = removed_after_inlining(tree, edited, name, helper.node, call, text)
        return fast if fast is not None else removed(edited, {name}, {name})[0], name
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
    """``(source with one single-use helper of ``names`` written in place of the statement that calls it and its
    definition left out, the helper's name)``, or ``None``: a call that is a whole statement (``x = f(...)``, ``f(...)``, ``return f(...)``)
    of a function, to a function whose one ``return`` ends it. Each parameter whose argument is another
    expression than a name, a constant or a field read, or that the helper assigns, is assigned first."""
    tree = parsed(source)
    parent_of = parents(tree)
    uses = uses_of(tree)
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
        call = parent_of.get(id(use))
        if body is None or not isinstance(call, ast.Call) or call.func is not use or node.args.vararg or \
                node.args.kwarg:
            continue
        statement = parent_of.get(id(call))
        target: Optional[str] = None
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1 and \
                isinstance(statement.targets[0], ast.Name):
            target = statement.targets[0].id
        elif not isinstance(statement, (ast.Expr, ast.Return)):
            continue
        caller = statement
        while caller is not None and not isinstance(caller, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            caller = parent_of.get(id(caller))
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
        assigned = bound_in(ast.Module(body=body, type_ignores=[])) - {a.arg for a in walk(
            ast.Module(body=body, type_ignores=[])) if isinstance(a, ast.arg)}
        caller_names = {n.id for n in walk(caller) if isinstance(n, ast.Name)} | \
            {a.arg for a in walk(caller) if isinstance(a, ast.arg)}
        arg_names = {n.id for a in bound.values() for n in walk(a) if isinstance(n, ast.Name)}  # type: ignore
        texts = {p: segment(source, a) for p, a in bound.items()}  # type: ignore[arg-type]
        first: List[str] = []
        replace: Dict[str, str] = {}
        for param, arg in bound.items():
            text = texts[param] or ""
            if text == param:
                if param in assigned and param != target:
                    break  # the helper would change the caller's own variable
                continue
            if simple(arg) and param not in assigned and "\n" not in text:  # type: ignore[arg-type]
                replace[param] = text
            else:
                first.append(f"{param} = {text}")
        else:
            locals_ = (assigned | {l.split(" = ")[0] for l in first}) - {target}
            scoped = {a.arg for stmt in body for n in walk(stmt) if isinstance(n, ast.Lambda)
                      for a in walk(n.args) if isinstance(a, ast.arg)}
            scoped |= {t.id for stmt in body for n in walk(stmt) if isinstance(n, ast.comprehension)
                       for t in walk(n.target) if isinstance(t, ast.Name)}
            reads = {n.id for stmt in body for n in walk(stmt) if isinstance(n, ast.Name)} - scoped
            if locals_ & caller_names or (target in arg_names and target in assigned) or \
                    (reads - set(bound) - assigned) & (bound_in(caller) - arg_names - {target}):
                continue
            indent = lines[statement.lineno - 1][:statement.col_offset]
            start, end = body[0].lineno, (body[-1].end_lineno or body[-1].lineno)
            body_indent = len(lines[start - 1]) - len(lines[start - 1].lstrip())
            if any(line.strip() and len(line) - len(line.lstrip()) < body_indent for line in lines[start - 1:end]):
                continue  # a line the dedent would cut (a string's continuation)
            region = parsed("\n".join(line[body_indent:] if line.strip() else line
                                         for line in lines[start - 1:end]))
            text_lines = [line[body_indent:] if line.strip() else "" for line in lines[start - 1:end]]
            edits = [(n.lineno, n.col_offset, n.end_col_offset, replace[n.id]) for n in walk(region)
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
                elif isinstance(statement, ast.Expr) and last.value is not None and not simple(last.value):
                    text_lines.append(value)  # a call's value the caller drops: the call still runs
                elif target is not None and value != target:
                    text_lines.append(f"{target} = {value}")
            elif not isinstance(statement, ast.Expr):
                continue
            new = [indent + line if line else "" for line in first + text_lines]
            if any(len(line) > 120 for line in new):
                continue
            out = lines[:statement.lineno - 1] + new + lines[(statement.end_lineno or statement.lineno):]
            return removed("\n".join(out) + "\n", {name}, {name})[0], name  # its definition, read nowhere now
    return None


def inlined(source: str, case: Dict[str, Any], statements: Set[str] = frozenset()) -> str:
    """``source`` (a written reproducer) with its single-use one-line helpers inlined (see the module), the case's
    branch of each ``x if <CASE test> else y`` kept, the writer's per-case names written where they are read, and
    what no code reads any more removed."""
    source = without_aliases(source)
    inlined_names: Set[str] = set()
    while True:
        # each with its definition, read nowhere now, left out: its calls count no more
        step = _inline_one(source, case) or _inline_statement(source, set(statements))
        if step is None:
            break
        source, name = step
        inlined_names.add(name)
    source = without_local_lambdas(without_empty_kwargs(fold_case_branches(source, case)))
    candidates = inlined_names | {"STATE"}  # and each imported name
    candidates |= {(a.asname or a.name).split(".")[0] for n in walk(parsed(source))
                   if isinstance(n, (ast.Import, ast.ImportFrom)) and getattr(n, "module", None) != "__future__"
                   for a in n.names}
    while candidates:
        source, freed = removed(source, candidates, inlined_names)
        candidates = freed - inlined_names
    return source
