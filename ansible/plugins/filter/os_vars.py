"""Jinja filter: the vars files a role reads for the node's operating system, most specific first.

Every role loads its OS variables with one task:
    ansible.builtin.include_vars: "{{ lookup('ansible.builtin.first_found', __x_os_vars) }}"
with `files: "{{ ansible_facts | os_vars_files }}"` and `paths: ["{{ role_path }}/vars"]`. A role ships only
the files that differ: `Ubuntu-24.yml` for one release, `Ubuntu.yml` for every Ubuntu, `Debian.yml` for the
whole Debian family (Ubuntu included), and `main.yml`, which the role loads anyway, as the last resort.
"""


def os_vars_files(facts):
    """File names, most specific first: distribution-major version, distribution, OS family, main.yml.

    facts is ansible_facts (the `min` subset holds all three keys); a missing or empty fact drops its name.
    """
    facts = facts or {}
    distribution = str(facts.get("distribution") or "")
    major = str(facts.get("distribution_major_version") or "")
    family = str(facts.get("os_family") or "")
    names = []
    if distribution and major:
        names.append(f"{distribution}-{major}.yml")
    for name in (distribution, family):
        if name:
            names.append(f"{name}.yml")
    names.append("main.yml")
    return list(dict.fromkeys(names))


class FilterModule:
    def filters(self):
        return {"os_vars_files": os_vars_files}
