"""Manual pages and shell completion, made from the argument parser so they cannot drift from it.

``python -m nodescope.clidocs --write packaging/common`` writes ``man/nodescope.1`` (the
command and its subcommands) and one ``man/nodescope-COMMAND.1`` per subcommand, and
``completion/nodescope.bash`` and ``completion/_nodescope`` (zsh); ``--check`` says whether the
committed files are current (the test suite runs it). The packages install them where man,
bash-completion and zsh look.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from nodescope import __version__
from nodescope.cli.main import build_parser

#: The manual's date is the version's, not the day it was written: the output is repeatable.
MAN_SECTION = "1"
MAN_SOURCE = f"nodescope {__version__}"


@dataclass(frozen=True)
class Command:
    """One command line as the parser declares it: ``words`` from ``nodescope`` down."""

    words: tuple[str, ...]
    parser: argparse.ArgumentParser
    help: str

    @property
    def name(self) -> str:
        return "-".join(self.words)


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:  # type: ignore[type-arg]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def commands(
    parser: argparse.ArgumentParser | None = None, words: tuple[str, ...] = ("nodescope",)
) -> Iterator[Command]:
    """The command and every subcommand, depth first."""
    parser = parser or build_parser()
    yield Command(words, parser, parser.description or "")
    sub = _subparsers(parser)
    if sub is None:
        return
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    for name, child in sub.choices.items():
        inner = commands(child, (*words, name))
        first = next(inner)
        yield Command(first.words, child, helps.get(name, "") or child.description or "")
        yield from inner


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS]


def _positionals(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if not a.option_strings and not isinstance(a, argparse._SubParsersAction)
    ]


# ---------------------------------------------------------------------------------------------
# roff


def _roff(text: str) -> str:
    """Text safe in a roff line: backslashes escaped, hyphens as minus signs (so options can be
    searched and copied), no control word at the start of a line."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join(
        "\\&" + line if line.startswith((".", "'")) else line for line in text.split("\n")
    )


def _help(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    text = action.help or ""
    if "%(" in text:
        formatter = parser._get_formatter()
        text = formatter._expand_help(action)
    return " ".join(text.split())


def _option_label(action: argparse.Action) -> str:
    names = ", ".join(f"\\fB{_roff(o)}\\fR" for o in action.option_strings)
    if action.nargs == 0:
        return names
    metavar = action.metavar or (
        "{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.dest.upper()
    )
    return f"{names} \\fI{_roff(str(metavar))}\\fR"


def man_page(command: Command, all_commands: list[Command]) -> str:
    parser = command.parser
    title = command.name.upper()
    usage = " ".join(parser.format_usage().removeprefix("usage: ").split())
    lines = [
        f'.TH "{title}" "{MAN_SECTION}" "" "{MAN_SOURCE}" "nodescope manual"',
        ".SH NAME",
        f"{_roff(command.name)} \\- {_roff(command.help or 'node agent for GPU clusters')}",
        ".SH SYNOPSIS",
        ".nf",
        _roff(usage),
        ".fi",
    ]
    description = parser.description or command.help
    if description:
        lines += [".SH DESCRIPTION", _roff(" ".join(description.split()))]
    children = [c for c in all_commands if c.words[:-1] == command.words]
    if children:
        lines.append(".SH COMMANDS")
        for child in children:
            lines += [".TP", f"\\fB{_roff(child.words[-1])}\\fR", _roff(child.help)]
    positionals = _positionals(parser)
    if positionals:
        lines.append(".SH ARGUMENTS")
        for action in positionals:
            lines += [
                ".TP",
                f"\\fI{_roff(str(action.metavar or action.dest))}\\fR",
                _roff(_help(action, parser)),
            ]
    options = _options(parser)
    if options:
        lines.append(".SH OPTIONS")
        for action in options:
            lines += [".TP", _option_label(action), _roff(_help(action, parser))]
    related = [c.name for c in all_commands if c is not command and len(c.words) <= 2]
    lines += [
        ".SH SEE ALSO",
        ", ".join(f"\\fB{_roff(name)}\\fR({MAN_SECTION})" for name in related),
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# bash


def _words_of(parser: argparse.ArgumentParser) -> list[str]:
    words = [o for a in _options(parser) for o in a.option_strings]
    sub = _subparsers(parser)
    if sub is not None:
        words = list(sub.choices) + words
    return words


def bash_completion(all_commands: list[Command]) -> str:
    """A completion function that knows each command line's subcommands and options, and
    completes file names after an option that takes a value (directories for ``DIR``)."""
    cases = []
    for command in all_commands:
        key = " ".join(command.words[1:])
        words = " ".join(_words_of(command.parser))
        options = _options(command.parser)
        arms = [
            f'{o}) COMPREPLY=($(compgen -W "{" ".join(map(str, a.choices))}" -- "$cur")); return ;;'
            for a in options
            if a.choices
            for o in a.option_strings
        ]
        kinds = (("DIR", "-d"), ("FILE", "-f"))
        for metavar, flag in kinds:
            named = "|".join(
                o
                for a in options
                if not a.choices and metavar in str(a.metavar or "")
                for o in a.option_strings
            )
            if named:
                arms.append(f'{named}) COMPREPLY=($(compgen {flag} -- "$cur")); return ;;')
        # Any other value (seconds, an address, a URL) has nothing to complete.
        others = "|".join(
            o
            for a in options
            if a.nargs != 0
            and not a.choices
            and not any(m in str(a.metavar or "") for m, _ in kinds)
            for o in a.option_strings
        )
        if others:
            arms.append(f"{others}) COMPREPLY=(); return ;;")
        cases.append(
            f'        "{key}")\n'
            f'            case "$prev" in\n'
            + "".join(f"                {arm}\n" for arm in arms)
            + "            esac\n"
            f'            COMPREPLY=($(compgen -W "{words}" -- "$cur")) ;;\n'
        )
    subcommands = {" ".join(c.words[1:]) for c in all_commands if _subparsers(c.parser) is not None}
    nested = " ".join(sorted(s for s in subcommands if s))
    return (
        "# bash completion for nodescope (generated by nodescope.clidocs from the parser)\n"
        "_nodescope() {\n"
        "    local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]}\n"
        "    local path='' i word\n"
        "    for ((i = 1; i < COMP_CWORD; i++)); do\n"
        "        word=${COMP_WORDS[i]}\n"
        "        [[ $word == -* ]] && continue\n"
        '        case " $(_nodescope_commands "$path") " in\n'
        '            *" $word "*) path=${path:+$path }$word ;;\n'
        "        esac\n"
        "    done\n"
        '    case "$path" in\n' + "".join(cases) + "    esac\n"
        "}\n"
        "_nodescope_commands() {\n"
        '    case "$1" in\n'
        + "".join(
            f'        "{" ".join(c.words[1:])}") echo "{" ".join(sub.choices)}" ;;\n'
            for c in all_commands
            if (sub := _subparsers(c.parser)) is not None
        )
        + "    esac\n"
        "}\n"
        f"# commands with subcommands: {nested or '-'}\n"
        "complete -F _nodescope nodescope\n"
    )


# ---------------------------------------------------------------------------------------------
# zsh


def _zsh_text(text: str) -> str:
    """Help text inside a zsh ``_arguments`` spec: brackets and colons end fields there."""
    text = " ".join(text.split()).replace("\\", "\\\\").replace("'", "'\\''")
    return re.sub(r"([\[\]:])", r"\\\1", text)


def _zsh_spec(action: argparse.Action, parser: argparse.ArgumentParser) -> list[str]:
    help_text = _zsh_text(_help(action, parser))
    if action.nargs == 0:
        value = ""
    elif action.choices:
        value = f":{action.dest}:({' '.join(map(str, action.choices))})"
    elif action.metavar == "DIR":
        value = f":{action.metavar}:_files -/"
    else:
        value = f":{_zsh_text(str(action.metavar or action.dest))}:_files"
    return [f"'{option}[{help_text}]{value}'" for option in action.option_strings]


def zsh_completion(all_commands: list[Command]) -> str:
    functions = []
    for command in all_commands:
        name = "_" + "_".join(w.replace("-", "_") for w in command.words)
        specs = [s for a in _options(command.parser) for s in _zsh_spec(a, command.parser)]
        sub = _subparsers(command.parser)
        body = ["    _arguments -C \\"]
        body += [f"        {spec} \\" for spec in specs]
        if sub is not None:
            described = " ".join(
                f"'{c.words[-1]}:{_zsh_text(c.help)}'"
                for c in all_commands
                if c.words[:-1] == command.words
            )
            body += [
                "        '1:command:->command' \\",
                "        '*::argument:->argument'",
                "    case $state in",
                f"        command) local -a cmds; cmds=({described}); _describe command cmds ;;",
                '        argument) local fn="' + name + '_${words[1]//-/_}";'
                " (( $+functions[$fn] )) && $fn ;;",
                "    esac",
            ]
        else:
            body += ["        '*:file:_files'"]
        functions.append(f"{name}() {{\n" + "\n".join(body) + "\n}")
    return (
        "#compdef nodescope\n"
        "# zsh completion for nodescope (generated by nodescope.clidocs from the parser)\n\n"
        + "\n\n".join(functions)
        + '\n\n_nodescope "$@"\n'
    )


def files() -> dict[str, str]:
    """Relative path -> content of every generated file."""
    every = list(commands())
    out = {f"man/{c.name}.{MAN_SECTION}": man_page(c, every) for c in every}
    out["completion/nodescope.bash"] = bash_completion(every)
    out["completion/_nodescope"] = zsh_completion(every)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", metavar="DIR", help="write the files under DIR")
    group.add_argument("--check", metavar="DIR", help="exit 1 when a file under DIR is stale")
    args = parser.parse_args(argv)
    generated = files()
    if args.write:
        root = Path(args.write)
        for relative, content in generated.items():
            path = root / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
        return 0
    root = Path(args.check)
    stale = [
        r for r, c in generated.items() if not (root / r).is_file() or (root / r).read_text() != c
    ]
    for relative in stale:
        print(
            f"{root / relative}: stale (python -m nodescope.clidocs --write {root})",
            file=sys.stderr,
        )
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
