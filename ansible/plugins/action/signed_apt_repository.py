"""Action plugin: a vendor's apt repository trusted through its own key alone.

One task does what each role used to spell out in six: get the key (download it on the node, or copy it from
the control machine), check that it carries the expected fingerprint before apt trusts anything, keep it
ASCII-armored in /etc/apt/keyrings, write a deb822 source with Signed-By naming that key only, and refresh
apt's lists when the key or the source changed. The fingerprint is read in Python on the control machine
(ansible/plugins/module_utils/apt_rules.py), so nodes need no gpg. Arguments are documented in
ansible/plugins/modules/signed_apt_repository.py.
"""
from __future__ import annotations

import base64
import posixpath
import runpy
from pathlib import Path

from ansible.plugins.action import ActionBase

# Action plugins cannot import module_utils: the repository's Python comes through module_utils/source_tree.py.
_load = runpy.run_path(str(Path(__file__).resolve().parents[1] / "module_utils" / "source_tree.py"))["load"]
apt_rules = _load("ansible/plugins/module_utils/apt_rules.py")

ARGUMENT_SPEC = {
    "name": {"type": "str", "required": True},
    "key_url": {"type": "str", "default": ""},
    "key_src": {"type": "str", "default": ""},
    "key_fingerprint": {"type": "str", "default": ""},
    "uris": {"type": "list", "elements": "str", "default": []},
    "suites": {"type": "list", "elements": "str", "default": []},
    "components": {"type": "list", "elements": "str", "default": []},
    "architectures": {"type": "list", "elements": "str", "default": []},
    "key_path": {"type": "str", "default": ""},
    "update_cache": {"type": "bool", "default": True},
    "state": {"type": "str", "default": "present", "choices": ["present", "absent"]},
}
SOURCES_DIR = "/etc/apt/sources.list.d"
MANAGED = "Managed by sd3-cluster's Ansible roles (signed_apt_repository); edits are overwritten."


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _supports_check_mode = True
    _VALID_ARGS = frozenset(ARGUMENT_SPEC)

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        del tmp
        _, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        self._vars = task_vars
        name = args["name"]
        key_path = args["key_path"] or f"/etc/apt/keyrings/{name}.asc"
        sources_path = f"{SOURCES_DIR}/{name}.sources"
        result.update(key_path=key_path, sources_path=sources_path, changed=False)

        if args["state"] == "absent":
            files = [{"path": sources_path, "state": "absent"}, {"path": key_path, "state": "absent"}]
            return self._write(result, args, files)

        problems = apt_rules.source_problems(name, args["uris"], args["suites"], args["components"],
                                             args["architectures"], key_path)
        if bool(args["key_url"]) == bool(args["key_src"]):
            problems.append("give exactly one of key_url (downloaded on the node) and key_src (a file on the "
                            "control machine)")
        problems += filter(None, [apt_rules.fingerprint_problem(args["key_fingerprint"])])
        if problems:
            return self._fail(result, f"repository {name}: " + "; ".join(problems) + ". Nothing was changed.")
        expected = apt_rules.normalize_fingerprint(args["key_fingerprint"])

        key, origin = self._key(result, args, key_path)
        if result.get("failed"):
            return result
        if key is None:
            # Check mode on a node without the key: downloading it would change the node.
            result.update(changed=True, msg=f"check mode: repository {name}: the key is not downloaded from "
                                            f"{args['key_url']}, so its fingerprint is checked on the real run")
            return result

        try:
            found = apt_rules.key_fingerprints(key)
            found_text = ", ".join(found)
        except apt_rules.KeyDataError as error:
            found, found_text = [], f"none (not an OpenPGP public key: {error})"
        result["fingerprints"] = found
        if expected not in found:
            return self._fail(result, (
                f"repository {name}: the key from {origin} has the fingerprint(s) {found_text}, not {expected} "
                "(key_fingerprint). No source trusts it: check the key's origin, then fix the URL, the file or the "
                "fingerprint" + (f", and delete {key_path}" if origin.startswith(key_path) else "") + "."))

        text = key.decode("ascii") if apt_rules.is_armored(key) else apt_rules.armor(key)
        source = apt_rules.render_source(args["uris"], args["suites"], args["components"], args["architectures"],
                                         key_path, MANAGED)
        directory = posixpath.dirname(key_path)
        made = self._module("ansible.legacy.file", {"path": directory, "state": "directory", "mode": "0755",
                                                    "owner": "root", "group": "root"})
        if made.get("failed"):
            return self._fail(result, f"repository {name}: cannot make {directory}: {made.get('msg')}")
        files = [{"path": key_path, "content": text}, {"path": sources_path, "content": source}]
        result = self._write(result, args, files)
        result["changed"] = result["changed"] or bool(made.get("changed"))
        return result

    def _module(self, module, module_args):
        return self._execute_module(module_name=module, module_args=module_args, task_vars=self._vars)

    @staticmethod
    def _fail(result, message):
        result.update(failed=True, msg=message)
        return result

    def _key(self, result, args, key_path):
        """(bytes of the key, where they came from); (None, ...) in check mode when the node lacks the key."""
        if args["key_src"]:
            try:
                local = self._find_needle("files", args["key_src"])
            except Exception as error:  # AnsibleError: the message names the paths searched
                self._fail(result, f"repository {args['name']}: key_src {args['key_src']}: {error}")
                return None, ""
            return Path(local).read_bytes(), args["key_src"]
        # A key already on the node is kept (as get_url keeps a file that exists): vendors rotate keys
        # rarely, and the fingerprint is checked again on every run.
        present = self._slurp(key_path)
        if present is not None:
            return present, f"{key_path} (downloaded from {args['key_url']})"
        if self._task.check_mode:
            return None, ""
        download = posixpath.join(self._make_tmp_path(), "key")
        fetched = self._module("ansible.legacy.get_url", {"url": args["key_url"], "dest": download, "mode": "0600"})
        if fetched.get("failed"):
            self._fail(result, f"repository {args['name']}: cannot download its key from {args['key_url']}: "
                               f"{fetched.get('msg')}")
            return None, ""
        return self._slurp(download) or b"", args["key_url"]

    def _slurp(self, path):
        answer = self._module("ansible.legacy.slurp", {"src": path})
        if answer.get("failed"):
            return None
        return base64.b64decode(answer["content"])

    def _write(self, result, args, files):
        written = self._module("managed_files", {"files": files, "mode": "0644", "owner": "root", "group": "root"})
        if written.get("failed"):
            return self._fail(result, f"repository {args['name']}: {written.get('msg')}")
        result["changed_paths"] = written.get("changed_paths", [])
        result["changed"] = bool(written.get("changed"))
        if "diff" in written:
            result["diff"] = written["diff"]
        if result["changed"] and args["update_cache"] and not self._task.check_mode:
            refreshed = self._module("ansible.legacy.apt", {"update_cache": True})
            if refreshed.get("failed"):
                return self._fail(result, f"repository {args['name']}: the source is written but apt cannot "
                                          f"refresh its lists: {refreshed.get('msg')}")
        return result

