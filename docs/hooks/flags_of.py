"""Print the flags a console script defines, as JSON, without running it.

    python docs/hooks/flags_of.py tfbig.commands.train:run tfbig-train

The script's entry point is called with no arguments and stopped at the moment it would parse
its command line, which is where every flag is defined and nothing has run yet:
- absl scripts through `tfbig.commands.cli.run_app` (sections as their `--help` groups them);
- absl scripts with their own `FlagValues` (tfbig-plan): the `FlagValues` being parsed;
- argparse scripts (`tfbig.commands.cli.ArgumentParser`): the parser's actions.
Run in a process of its own per script: absl's global FLAGS would otherwise collide.
Output: {"prog", "summary", "sections": [{"title", "flags": [{"name", "type", "default", "help"}]}]}.
"""
import argparse
import importlib
import json
import sys


class _Stop(Exception):
    pass


def _absl_flag(flag):
    default = flag.default
    if isinstance(default, (list, tuple)):
        default = ",".join(map(str, default))
    return {"name": flag.name, "type": "bool" if flag.boolean else flag.flag_type(),
            "default": default, "help": " ".join((flag.help or "").split())}


def _own_absl_names(flag_values):
    names = [f.name for module, found in flag_values.flags_by_module_dict().items()
             if not module.startswith("absl.") for f in found]
    return list(dict.fromkeys(names))


def extract(entry, prog):
    from absl import flags

    from tfbig.commands import cli

    captured = {}

    def run_app(prog_, main, summary, sections):
        captured.update(summary=summary, sections=[
            {"title": title, "flags": [_absl_flag(flags.FLAGS[n]) for n in names]}
            for title, names in sections])
        raise _Stop

    def flag_values_call(self, argv, known_only=False):
        names = _own_absl_names(self)
        captured.update(sections=[{"title": "flags", "flags": [_absl_flag(self[n]) for n in names]}])
        raise _Stop

    def parse_args(self, args=None, namespace=None):
        found = []
        for action in self._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    for a in sub._actions:
                        if not isinstance(a, argparse._HelpAction):
                            found.append(_argparse_flag(a, f"{name} "))
                continue
            found.append(_argparse_flag(action))
        captured.update(summary=self.description or "", sections=[{"title": "arguments", "flags": found}])
        raise _Stop

    cli.run_app = run_app
    flags.FlagValues.__call__ = flag_values_call
    argparse.ArgumentParser.parse_args = parse_args
    module_name, function = entry.split(":")
    sys.argv = [prog]
    module = importlib.import_module(module_name)
    if not captured.get("summary"):
        captured["summary"] = (module.__doc__ or "").strip()
    try:
        getattr(module, function)()
    except _Stop:
        pass
    if "sections" not in captured:
        raise SystemExit(f"{prog}: {entry} ended without parsing flags; its flags are unknown")
    captured["summary"] = captured.get("summary") or (module.__doc__ or "").strip()
    return {"prog": prog, **captured}


def _argparse_flag(action, prefix=""):
    name = action.option_strings[-1].lstrip("-") if action.option_strings else action.dest
    kind = ("bool" if action.nargs == 0 else getattr(action.type, "__name__", None) or "string")
    if not action.option_strings:
        kind = "positional"
    default = action.default if action.default is not argparse.SUPPRESS else None
    return {"name": prefix + name, "type": kind, "default": default,
            "help": " ".join((action.help or "").split())}


if __name__ == "__main__":
    print(json.dumps(extract(sys.argv[1], sys.argv[2]), default=str))
