"""The `patchpar` command: parses a typed config and hands it to a library function.

patchpar run [CONFIG.yaml] [--dotted.overrides ...]   one run -> one record
patchpar sweep SWEEP.yaml                             a resumable grid of runs
patchpar table RESULTS...                             markdown table of records
patchpar plot RESULTS...                              PNG plots of records
patchpar generate ...                                 images from prompts, no record
patchpar comm ...                                     bytes and FLOPs of one UNet call
patchpar project ...                                  latency projected on hardware profiles

`--debug` anywhere on the line shows a failure's traceback instead of its one-line message;
`--no-compile-cache` runs without the persistent compilation cache (`patchpar.compile_cache`:
on by default for run, sweep and generate, in $PATCHPAR_HOME/compile-cache).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any, NamedTuple


def _run_config(args: list[str]):
    """`run`: an optional YAML path first, then tyro's dotted overrides on top of it."""
    import tyro

    from patchpar.lab.config import RunConfig
    from patchpar.lab.configio import load_config

    path = args[0] if args and not args[0].startswith("-") else None
    default = load_config(path) if path else RunConfig()
    return tyro.cli(
        RunConfig,
        default=default,
        args=args[1:] if path else args,
        prog="patchpar run [CONFIG.yaml]",
        description="One experiment run: generate for the prompt set under a strategy, time it, "
        "count communication, compare with the single-device outputs, append a record. "
        "Flags override the YAML's values (`--strategy.portion 0.5`).",
    )


def _subcommands() -> dict:
    """command name -> the config class it parses (tyro's subcommands)."""
    return {name: command.config() for name, command in COMMANDS.items()}


def dispatch(config, args: list[str] | None = None) -> None:
    """Hand a parsed config to its command's function (`COMMANDS`), which prints what it
    returns. `args`, the command line, is what launched workers run (`patchpar generate
    --processes N`)."""
    for command in COMMANDS.values():
        if isinstance(config, command.config()):
            return command.run(config, args or [])
    raise TypeError(f"no command takes a {type(config).__name__}")


def _run(config, args: list[str]) -> None:
    from patchpar.lab import launch
    from patchpar.lab.runner import run, runs_path
    from patchpar.lab.tables import markdown, summary_columns

    if not config.mesh.processes:
        launch.request_cpu_devices(config.mesh.devices, _stderr)
    rec = run(config, raise_errors=True)
    if launch.is_writer() and not launch.launched_worker():  # the launcher prints it
        print(markdown([rec], summary_columns([rec])))
        print(f"record {rec['run_id']} -> {runs_path(config)}")


def _sweep(config, args: list[str]) -> None:
    from patchpar.lab.sweep import run_sweep
    from patchpar.lab.tables import markdown, summary_columns

    records = run_sweep(config)
    if records:
        print(markdown(records, summary_columns(records), sort_by=("mesh.devices", "label")))
    failed = [r for r in records if r.get("status") != "ok"]
    if failed:  # recorded and the sweep went on, but the command did not fully succeed
        raise Failed(
            f"{len(failed)} of {len(records)} sweep points did not run "
            f"({', '.join(sorted({r['status'] for r in failed}))}): "
            + "; ".join(f"{r.get('label')}: {r.get('error')}" for r in failed[:3])
        )


def _table(config, args: list[str]) -> None:
    from patchpar.lab.tables import run_table

    print(run_table(config))


def _plot(config, args: list[str]) -> None:
    from patchpar.lab.plots import plots_folder, run_plot

    for name, where in run_plot(config).items():
        print(f"{name}: {where}")
    print(f"plots -> {plots_folder(config)}")


def _generate(config, args: list[str]) -> None:
    from patchpar.lab import launch
    from patchpar.lab.generate import check, generate, launched_generate

    if not config.mesh.processes:  # before the checks: they build the mesh
        launch.request_cpu_devices(config.mesh.devices, _stderr)
    if not launch.launched_worker():  # the launcher has checked (and said its warnings)
        for msg in check(config):  # bad flags: errors before any work or launch
            _stderr(f"patchpar: warning: {msg}")
    if config.mesh.processes and not launch.in_worker():
        record = launched_generate(config, args, checked=True)
    else:
        record = generate(config, log=_stderr, checked=True)
    if not launch.is_writer() or launch.launched_worker():
        return
    for path in record["images"]:
        print(path)
    cached = (
        f"; {record['cache']}: {record['cache_computed_steps']} of {config.sampler.steps} steps ran "
        f"every block, {record['blocks_computed']:.0%} of the block calls"
        if "cache" in record else ""
    )  # fmt: skip
    print(
        f"{record['strategy']} on {record['devices']} device(s): latent {record['latent_shape']} "
        f"-> {config.out}/latent.npy ({record['generate_s_including_compile']:.1f} s including "
        f"compile; stale buffers {record['stale_bytes_per_device'] / 2**20:.2f} MiB per device"
        f"{cached})"
    )


def _comm(config, args: list[str]) -> None:
    import json

    from patchpar.lab import launch
    from patchpar.lab.costs import format_comm, run_comm

    launch.request_cpu_devices(config.mesh.devices, _stderr)
    rec = run_comm(config, log=_stderr)
    print(json.dumps(rec, sort_keys=True) if config.json else format_comm(rec))


def _project(config, args: list[str]) -> None:
    import json

    from patchpar.lab import launch
    from patchpar.lab.project import run_project
    from patchpar.lab.project_table import format_project

    launch.request_cpu_devices(config.mesh.devices, _stderr)
    rows = run_project(config, log=_stderr)
    if config.json:
        for row in rows:
            print(json.dumps(row, sort_keys=True))
    else:
        print(format_project(rows))


def _calibrate(config, args: list[str]) -> None:
    from patchpar.lab import launch
    from patchpar.lab.calibrate import format_calibrate, run_calibrate

    if not config.processes:
        launch.request_cpu_devices(config.devices, _stderr)
    record = run_calibrate(config, args, log=_stderr)
    if launch.is_writer() and not launch.launched_worker():  # the launcher prints it
        print(format_calibrate(record))
        print(f"-> {config.out}")


def _config(module: str, name: str):
    """The config class `name` of `patchpar.lab.<module>`, imported when asked for (the CLI's
    start stays light)."""
    import importlib

    return lambda: getattr(importlib.import_module(f"patchpar.lab.{module}"), name)


class Command(NamedTuple):
    config: Callable[[], type]  # the config class it parses
    run: Callable[[Any, list[str]], None]  # what it does with it (prints what it returns)


NESTED = (
    "run",
    "generate",
    "comm",
    "project",
    "calibrate",
)  # the nested spec's commands: short flags too

COMMANDS = {  # the `patchpar` commands, in --help's order
    "run": Command(_config("config", "RunConfig"), _run),
    "sweep": Command(_config("sweep", "SweepConfig"), _sweep),
    "table": Command(_config("tables", "TableConfig"), _table),
    "plot": Command(_config("plots", "PlotConfig"), _plot),
    "generate": Command(_config("generate", "GenerateConfig"), _generate),
    "comm": Command(_config("costs", "CommConfig"), _comm),
    "project": Command(_config("project", "ProjectConfig"), _project),
    "calibrate": Command(_config("calibrate", "CalibrateConfig"), _calibrate),
}


class Failed(Exception):
    """The command ran but did not succeed (e.g. sweep points recorded with status error);
    the message says what, without a traceback."""


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 done, 2 bad input (a ValueError: names the value and what fits), 1 any
    other failure, 130 interrupted. A failure prints one line on stderr; `--debug` (anywhere
    on the line) prints the traceback instead. A warning prints one line too (`patchpar:
    warning: ...`)."""
    from patchpar.lab import launch

    launch.setup_worker()  # a launched worker: pinned to its core, one thread, before JAX starts
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    if "--no-compile-cache" in args:  # an environment variable: launched workers inherit it
        from patchpar.compile_cache import ENV

        os.environ[ENV] = "off"
    args = [a for a in args if a not in ("--debug", "--no-compile-cache")]
    with _one_line_warnings():
        return _command(args, debug)


def _command(args: list[str], debug: bool) -> int:
    """Parse `args`, run the command, and turn a failure into its exit code and one line."""
    import tyro

    from patchpar.lab import launch

    try:
        args, cluster = launch.pop_cluster_flags(args)
        with _one_line_usage_errors(args):
            args = _short_flags(args)
            if args and args[0] == "run":
                config = _run_config(args[1:])
            else:
                config = tyro.extras.subcommand_cli_from_dict(
                    _subcommands(),
                    prog="patchpar",
                    description="Patch-parallel diffusion inference in JAX. `patchpar run` takes "
                    "a YAML config path before its flags.",
                    args=args,
                )
        if cluster is not None:
            launch.join(cluster)
        dispatch(config, args)
    except KeyboardInterrupt:
        print("patchpar: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            raise
        if isinstance(e, launch.WorkerFailed):
            print(f"patchpar: error: {_one_line(str(e))}", file=sys.stderr)
            return e.exit_code
        if isinstance(e, ValueError):  # bad input: the message names the value and what fits
            from patchpar.lab.checks import Problems

            for line in e.lines if isinstance(e, Problems) else [str(e)]:  # all found, a line each
                print(f"patchpar: error: {_one_line(line)}", file=sys.stderr)
            return 2
        if isinstance(e, Failed):
            print(f"patchpar: error: {_one_line(str(e))}", file=sys.stderr)
            return 1
        print(
            f"patchpar: error: {type(e).__name__}: {_one_line(str(e))} (--debug shows the traceback)",
            file=sys.stderr,
        )
        return 1
    return 0


@contextlib.contextmanager
def _one_line_warnings():
    """While the command runs, every warning shown is one line on stderr, `patchpar: warning:
    <message>`, instead of Python's `file:line: UserWarning: ...` and the source line. Only how
    they are shown changes: the filters still decide which are shown, raised (`-W error`) or
    ignored, and a `warnings.catch_warnings(record=True)` around the command (pytest.warns)
    still records each one."""
    before = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        _stderr(f"patchpar: warning: {_one_line(str(message))}")
        record = getattr(warnings, "_showwarnmsg_impl", None)  # a recorder's `log.append`
        if isinstance(getattr(record, "__self__", None), list):
            record(warnings.WarningMessage(message, category, filename, lineno, file, line))

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = before


@contextlib.contextmanager
def _one_line_usage_errors(args: list[str]):
    """tyro reports a command-line error (a value of the wrong type, an unknown or missing
    option) as a box of 9-15 lines and exits 2: say it in one line instead, with the options it
    suggests, each flag as the user gave it (or can: a nested flag by its short form, unless
    the nested one was typed). `--help` (exit 0) prints as tyro made it."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stderr(buffer):
            yield
    except SystemExit as e:
        text = buffer.getvalue()
        if e.code in (0, None) or not text.strip():
            sys.stderr.write(text)
            raise
        shown = _short_names(args)
        line = re.sub(r"--[\w.-]+", lambda m: shown.get(m.group(0), m.group(0)),
                      usage_error_line(text))  # fmt: skip
        if line.startswith("Unrecognized options:") and args and args[0] in COMMANDS:
            line = _own_suggestions(line, args[0])
        print(f"patchpar: error: {_merged_suggestions(line)}", file=sys.stderr)
        raise SystemExit(2) from None
    sys.stderr.write(buffer.getvalue())


def _short_names(args: list[str]) -> dict[str, str]:
    """nested flag -> its short flag, for messages (`options.flat_aliases` of every nested
    command); none where the command line writes nested flags itself (`--sampler.stepz`
    is then answered with `--sampler.steps`)."""
    from patchpar.lab.options import flat_aliases

    if any(a.startswith("--") and "." in a.split("=")[0] for a in args):
        return {}
    out: dict[str, str] = {}
    for name in NESTED:
        for short, nested in flat_aliases(COMMANDS[name].config()).items():
            out.setdefault(nested, short)
    return out


def _own_suggestions(line: str, command: str) -> str:
    """`Unrecognized options: --stepz 3` said as not options of `command`, with the options of
    `command` close to each flag typed (its short flags too, which tyro does not know) in
    place of tyro's suggestions, where there are any."""
    import difflib

    from patchpar.lab.options import flat_aliases

    head, sep, rest = line.partition("; did you mean ")
    tail = rest.rpartition("?")[2] if sep else ""
    if not sep:
        head, _, tail = line.partition(" (--help")
        tail = " (--help" + tail
    config = COMMANDS[command].config()
    aliases = flat_aliases(config) if command in NESTED else {}
    known = [*aliases, *aliases.values()]
    for f in fields(config):
        known += [f"--{f.name.replace('_', '-')}"] + [f"--no-{f.name.replace('_', '-')}"] * (
            f.type in (bool, "bool"))  # fmt: skip
    typed = re.findall(r"--[\w.-]+", head.partition("options:")[2])
    close = [m for flag in typed for m in difflib.get_close_matches(flag, known, n=3, cutoff=0.8)]
    said = f"{head} (not options of patchpar {command})"
    if close:
        return f"{said}; did you mean {', '.join(dict.fromkeys(close))}?{tail}"
    return f"{said}{sep}{rest}" if sep else f"{said}{tail}"


def _merged_suggestions(line: str) -> str:
    """`did you mean --x (patchpar generate), --x (patchpar project)?` as `--x (patchpar
    generate, project)`: one flag that short names made the same in several commands."""
    head, sep, rest = line.partition("; did you mean ")
    if not sep:
        return line
    body, _, tail = rest.rpartition("?")
    merged: dict[str, list[str]] = {}
    here = set()  # flags of the command typed (named without a command)
    for item in re.findall(r"(--[\w.-]+)(?: \(patchpar ([^)]*)\))?", body):
        subs = merged.setdefault(item[0], [])
        subs += [s.strip() for s in item[1].split(",") if s.strip() and s.strip() not in subs]
        if not item[1]:
            here.add(item[0])
    named = [f"{f} (patchpar {', '.join(s)})" if s and f not in here else f
             for f, s in merged.items()]  # fmt: skip
    return f"{head}; did you mean {', '.join(named)}?{tail}"


# what a value of each tyro metavar is, in words: (one, several)
_METAVARS = {
    "INT": ("an integer", "integers"),
    "FLOAT": ("a number", "numbers"),
    "STR": ("a string", "strings"),
    "PATH": ("a path", "paths"),
}


def _expected(metavar: str) -> str:
    """A tyro metavar (`INT`, `{None}|FLOAT`, `[INT [INT ...]]`, `{a,b}`) in words."""
    metavar = metavar.replace("{None}|", "")
    if metavar == "[True|False]":  # a boolean strategy option (config._bare_flag)
        return "no value (a bare flag) or True or False"
    if metavar.startswith("["):  # a list: its values one after another, space-separated
        inner = metavar.strip("[]. ").split()[0]
        several = _METAVARS.get(inner, (inner, inner + " values"))[1]
        return f"{several} separated by spaces (e.g. `0 1 2`), not a bracketed list"
    if metavar.startswith("{"):
        return "one of " + ", ".join(metavar.strip("{}").split(","))
    return _METAVARS.get(metavar, (metavar,))[0]


def _typed_error(lines: list[str]) -> str | None:
    """`--steps='2.5': expected an integer` from a box whose message is `Error parsing --steps:
    ...` and whose helptext names the flag's metavar; None for any other box."""
    rows = [ln.strip("│|╭╰─ ").strip() for ln in lines]
    head = next((r for r in rows if r.startswith("Error parsing --")), None)
    if head is None or "Argument helptext:" not in rows:
        return None
    flag = head.removeprefix("Error parsing ").split(":")[0]
    usage = rows[rows.index("Argument helptext:") + 1]
    if not usage.startswith(flag + " "):
        return None
    message = " ".join(rows[rows.index(head) : rows.index("Argument helptext:")]).strip("─ ")
    values = re.findall(r"'([^']*)'", message)
    got = f"={values[-1]!r}" if values else ""
    return f"{flag}{got}: expected {_expected(usage.removeprefix(flag).strip())}"


def usage_error_line(box: str) -> str:
    """One line from tyro's error box: a value of the wrong type as `--flag='value': expected
    <what>`, else its message (up to the first rule, without tyro's list of per-type errors)
    and the options listed under "Perhaps you meant"."""
    message, suggested, part = [], {}, 0
    lines = [ln.strip() for ln in box.splitlines() if ln.strip()]
    typed = _typed_error(lines)
    if typed is not None:
        return typed + " (--help lists every option)"
    last = None
    for line in lines[1:]:  # after the title (a box's top edge, or a line of its own)
        if line[0] in "╭╰":  # a box's bottom edge
            continue
        row = line.strip("│|").strip()
        if row and set(row) <= set("─-="):  # a rule between the parts (one may follow the title)
            part += bool(message)
        elif row == "Got errors:":  # tyro's per-type attempts: the message is complete
            part = max(part, 1)
        elif part == 0 and row:
            message.append(row)
        elif part == 1 and row.startswith("--"):
            last = row.split()[0]
            suggested.setdefault(last, [])
        elif part == 1 and last and row.startswith("in patchpar ") and row.endswith("--help"):
            # a suggestion that is another subcommand's option: say whose
            suggested[last].append(row.removeprefix("in patchpar ").split()[0])
        elif row.startswith("Available subcommands"):
            message.append(f"({row})")
    text = " ".join(message)
    # "Unrecognized options: --x, 3, --y": each flag with its values, "--x 3, --y"
    text = re.sub(r"(?<=options: )([^(;]*)", lambda m: re.sub(r", (?!--)", " ", m.group(1)), text)
    # "--x (applied to patchpar comm)": said once, without tyro's note on ordering
    where = sorted(set(re.findall(r" \(applied to (patchpar \w+)\)", text)))
    text = re.sub(r" \(applied to patchpar \w+\)", "", text)
    text = text.split(" Arguments are applied to")[0]
    if where:
        text += f" (not options of {', '.join(where)})"
    if suggested and "Perhaps you meant" in box:
        text = text.replace(" Perhaps you meant:", "")
        named = [f"{flag} ({'patchpar ' + ', '.join(subs)})" if subs else flag
                 for flag, subs in suggested.items()]  # fmt: skip
        text += f"; did you mean {', '.join(named)}?"
    return text + " (--help lists every option)"


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _short_flags(args: list[str]) -> list[str]:
    """A command line with the short flags of its command's nested sections written out
    (`patchpar generate --devices 2` is `--mesh.devices 2`; `options.flat_aliases`, made from
    the sections' fields)."""
    from patchpar.lab.options import expand_aliases, flat_aliases

    if not args or args[0] not in NESTED:
        return args
    return [args[0], *expand_aliases(args[1:], flat_aliases(COMMANDS[args[0]].config()))]


def _one_line(text: str) -> str:
    return " ".join(text.split()) or "(no message)"


if __name__ == "__main__":
    sys.exit(main())
