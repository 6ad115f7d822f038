#!/usr/bin/env bash
# Usage: benchmarks/ansible_repetition.sh TREE
# How much the Ansible tree repeats itself: pairs of places sharing 6+ lines among roles/, ansible/ and the
# top-level playbooks (a duplicate finder, `duplicates`, reads them as .py copies since it skips YAML), and the
# lines of rule logic written in Jinja (problem templates, day-2 templates, {% %} in YAML).
set -euo pipefail
tree=$1; tmp=$(mktemp -d)
cd "$tree"
files=$(git ls-files roles ansible ':(glob)*.yml' | grep -E '\.ya?ml$')
for f in $files; do mkdir -p "$tmp/$(dirname "$f")"; cp "$f" "$tmp/${f%.*}.py"; done
(cd "$tmp" && git init -q && git add -A && git -c user.email=x@x -c user.name=x commit -qm x)
report=$(duplicates --repo "$tmp" --most 200 --seconds 120)
echo "$report" | head -1
echo "pairs: $(echo "$report" | grep -c '^D'), of which galaxy metadata (meta/main.yml against meta/main.yml):" \
     "$(echo "$report" | grep '^D' | grep -c 'meta/main.py.*meta/main.py')"
echo "problems/day2 template lines: $(cat $(git ls-files 'roles/*problems*.j2' 'roles/day2/templates/*' 'ansible/playbooks/day2/templates/*') /dev/null | wc -l)"
echo "YAML lines with {% (inline Jinja control): $(echo "$files" | xargs grep -h '{%' | wc -l)"
rm -rf "$tmp"
