"""Jinja filter: what is wrong with a path on a node, from ansible.builtin.stat's result, in words.

"does not exist" is only true when nothing is there: a folder where a command should be, or a file where a
folder should be, is said as such, so the user fixes the right thing. Roles call it as
`__stat.stat | path_kind_problem(path, 'executable')` and stop when it returns a sentence.
"""

KINDS = {"executable": "an executable file", "file": "a file", "dir": "a folder"}


def _found(stat):
    if stat.get("isdir"):
        return "a folder"
    if stat.get("islnk") and not stat.get("lnk_target_exists", True):
        return "a broken symbolic link"
    if stat.get("isreg"):
        return "a file that is not executable" if not stat.get("executable") else "an executable file"
    return "neither a file nor a folder"


def path_kind_problem(stat, path, kind):
    """'' when stat (the `stat` key of ansible.builtin.stat's result) shows path as kind (executable, file or
    dir); otherwise a sentence that says what is there instead."""
    if kind not in KINDS:
        raise ValueError(f"path_kind_problem: kind must be one of {', '.join(KINDS)}, not {kind!r}")
    stat = stat or {}
    if not stat.get("exists"):
        return f"{path} does not exist"
    ok = {"executable": bool(stat.get("isreg") and stat.get("executable")),
          "file": bool(stat.get("isreg")), "dir": bool(stat.get("isdir"))}[kind]
    if ok:
        return ""
    return f"{path} is {_found(stat)}, not {KINDS[kind]}"


class FilterModule:
    def filters(self):
        return {"path_kind_problem": path_kind_problem}
