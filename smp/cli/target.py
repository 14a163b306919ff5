"""TARGET: the model a command works on, with one example microbatch, as named on the command line.

``zoo:NAME`` builds a model of :mod:`smp.zoo` (random weights, nothing downloaded); ``path/to/file.py:factory``
imports the file and calls the function, which returns ``(model, example_args)`` or ``(model, args, kwargs)``.
Everything that can go wrong in the user's file (a syntax error, an exception, ``sys.exit``, a wrong return
value) becomes a :class:`~smp.cli.errors.CLIError` that names the file and the factory.
"""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from smp.cli.errors import CLIError

__all__ = ["Target", "parse_target", "load_target", "trace_target", "pricing_threads", "priced_options"]

SHAPE = "(model, example_args) or (model, args, kwargs)"


@dataclass
class Target:
    """A model with one example microbatch, as named on the command line."""

    spec: str
    model: Any
    args: tuple
    kwargs: dict
    blocks: str = ""


def parse_target(spec: str) -> tuple[str, str]:
    """``zoo:gpt2`` -> ("zoo", "gpt2"); ``models/net.py:build`` -> ("models/net.py", "build")."""
    spec = spec.strip()
    if spec.startswith("zoo:"):
        name = spec[4:]
        if not name:
            raise CLIError("TARGET 'zoo:' names no model: write zoo:NAME, e.g. zoo:gpt2")
        return "zoo", name
    if ":" not in spec:
        if spec.endswith(".py"):
            raise CLIError(f"TARGET {spec!r} names no factory: write {spec}:FUNCTION, where FUNCTION() returns {SHAPE}")
        raise CLIError(f"TARGET {spec!r} is neither zoo:NAME nor path/to/file.py:factory (did you mean zoo:{spec}?)")
    path, factory = spec.rsplit(":", 1)
    if not path or not factory:
        raise CLIError(f"TARGET {spec!r} must look like path/to/file.py:factory")
    return path, factory


def load_target(spec: str, *, size: str = "small", batch: int = 4,
                progress: Callable[[str], None] = lambda m: None) -> Target:
    """Build the model and its example inputs named by ``spec`` (see :func:`parse_target`)."""
    where, name = parse_target(spec)
    if where == "zoo":
        progress(f"building {spec} ({size}, batch {batch})")
        from smp import zoo

        if name not in zoo.NAMES:
            raise CLIError(f"unknown zoo model {name!r} in TARGET {spec!r}; built-in models: {', '.join(zoo.NAMES)}")
        try:
            z = zoo.build(name, batch=batch, size=size)
        except ImportError as exc:
            raise CLIError(f"zoo:{name} needs a missing package ({exc}); install it with pip install "
                           "'smp-engine[zoo]'") from None
        return Target(spec, z.model, tuple(z.args), dict(z.kwargs), z.blocks)
    return _load_factory(spec, where, name, progress)


def _import_file(spec: str, path: str) -> Any:
    """The user's file as a module; its folder goes on ``sys.path`` so that it can import its neighbours."""
    if not os.path.exists(path):
        raise CLIError(f"TARGET {spec!r}: no such file {path!r}")
    if not os.path.isfile(path):
        raise CLIError(f"TARGET {spec!r}: {path!r} is not a file")
    mod_name = "_smp_target_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    if module_spec is None or module_spec.loader is None:
        raise CLIError(f"TARGET {spec!r}: cannot import {path!r} as Python (is it a .py file?)")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as exc:
        raise CLIError(f"cannot import {path}: SyntaxError at line {exc.lineno}: {exc.msg}") from None
    except SystemExit as exc:
        raise CLIError(f"cannot import {path}: it called sys.exit({exc.code!r}) while being imported; keep "
                       "script code under if __name__ == '__main__':") from None
    except Exception as exc:
        raise CLIError(f"cannot import {path}: {type(exc).__name__}: {_first_line(exc)}") from None
    return module


def _missing_factory(spec: str, path: str, factory: str, module: Any) -> CLIError:
    """The error for a factory the file does not define, listing what it does define."""
    mine = {k: v for k, v in vars(module).items()
            if not k.startswith("_") and callable(v) and getattr(v, "__module__", None) == module.__name__}
    functions = sorted(k for k, v in mine.items() if not inspect.isclass(v))
    classes = sorted(k for k, v in mine.items() if inspect.isclass(v))
    hint = f"; functions defined there: {', '.join(functions)}" if functions else "; it defines no functions"
    if classes:
        hint += f" (classes, not factories: {', '.join(classes)})"
    return CLIError(f"TARGET {spec!r}: {path} has no function {factory!r}{hint}")


def _load_factory(spec: str, path: str, factory: str, progress: Callable[[str], None]) -> Target:
    progress(f"importing {path}")
    module = _import_file(spec, path)
    fn = getattr(module, factory, None)
    if fn is None:
        raise _missing_factory(spec, path, factory, module)
    if not callable(fn):
        raise CLIError(f"TARGET {spec!r}: {factory!r} in {path} is a {type(fn).__name__}, not a function")
    progress(f"calling {factory}()")
    try:
        result = fn()
    except SystemExit as exc:
        raise CLIError(f"{path}:{factory}() called sys.exit({exc.code!r}); a factory must return {SHAPE}") from None
    except Exception as exc:
        raise CLIError(f"{path}:{factory}() raised {type(exc).__name__}: {_first_line(exc)}") from None
    import torch

    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise CLIError(f"{path}:{factory}() returned {type(result).__name__}; it must return {SHAPE}")
    model, args = result[0], result[1]
    kwargs = result[2] if len(result) == 3 else {}
    if not isinstance(model, torch.nn.Module):
        raise CLIError(f"{path}:{factory}() returned a {type(model).__name__} as the model; it must be a "
                       f"torch.nn.Module ({SHAPE})")
    if not isinstance(args, (tuple, list)):
        args = (args,)
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise CLIError(f"{path}:{factory}() returned {type(kwargs).__name__} as kwargs; it must be a dict")
    return Target(spec, model, tuple(args), dict(kwargs))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@contextlib.contextmanager
def pricing_threads(device: str, ranks: int) -> Iterator[None]:
    """While a job of ``ranks`` ranks on ``device`` is priced, and they are several on this machine's CPU: torch's
    intra-op threads as each rank will have them, one (``smp launch`` sets ``OMP_NUM_THREADS=1`` for more than one
    process), so that the timed ops and the calibrated rates (:func:`partitioner.calibrate`, kept per thread count)
    are the ranks', and with this machine's runtime costs per pass and per step, measured on first use
    (:func:`smp.cli.runtime_costs.ensure_runtime_costs`)."""
    import torch

    from smp.cli.runtime_costs import ensure_runtime_costs

    if device != "cpu" or ranks < 2:
        yield
        return
    ensure_runtime_costs()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def priced_options(opts: Any, target: Target) -> Any:
    """``opts`` as ``target`` can be priced: a model on the meta device cannot run, so its ops are not timed but
    estimated (as with ``--estimate``), and a warning says so."""
    from smp.engine.materialize import has_meta

    if opts.partition.measure and has_meta(target.model):
        print(f"smp: warning: {target.spec} is on the meta device, so its ops cannot be timed on this machine: the "
              "cost model prices them (as with --estimate)", file=sys.stderr, flush=True)
        return opts.with_partition(measure=False)
    return opts


def trace_target(target: Target, progress: Callable[[str], None], opts: Any = None) -> Any:
    """The target's :class:`partitioner.OpGraph`; torch.export's own logs are kept out of the terminal. When
    ``opts`` time the ops (``measure``: on ``--device cpu`` unless ``--estimate``; see :func:`priced_options`), they
    are timed here, once (:attr:`partitioner.OpGraph.timed`)."""
    import partitioner

    progress(f"tracing {target.spec} with torch.export")
    # torch.export logs pages of warnings and graph dumps before it raises; the one-line error says what went
    # wrong and how to fix it (SMP_TRACEBACK=1 keeps the logs and shows the traceback).
    if os.environ.get("SMP_TRACEBACK"):
        graph = partitioner.trace(target.model, target.args, target.kwargs)
    else:
        logging.disable(logging.CRITICAL)
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                graph = partitioner.trace(target.model, target.args, target.kwargs)
        finally:
            logging.disable(logging.NOTSET)
    progress(f"traced {graph.describe()}")
    if opts is not None and opts.partition.measure:
        from partitioner.cost.op_times import timed_costs

        progress("timing every op's forward and backward on this machine, or reading them from its cache "
                 "(--estimate: the cost model instead)")
        graph.timed = timed_costs(graph, target.args, target.kwargs, opts.partition.resolve_rates())
    return graph


def rank_target(graph: Any, degree: int, flag: str, doing: str, write: Callable[[Any, int, int], Any],
                progress: Callable[[str], None] = lambda m: None) -> Any:
    """The graph rank 0 of an axis of ``degree`` runs (``graph`` for 1), written by ``write(graph, degree, 0)``
    (``doing``: what the progress line says); what it cannot split refused in the command line's terms (``flag``:
    the option, ``--ep``)."""
    if degree == 1:
        return graph
    if graph.fx is None:
        raise CLIError(f"{flag} {degree} needs a traced model, not a synthetic graph")
    progress(doing)
    try:
        return write(graph, degree, 0)
    except ValueError as exc:
        raise CLIError(f"{flag} {degree}: {exc}") from None
