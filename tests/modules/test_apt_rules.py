"""The rules of the apt plugins (ansible/plugins/module_utils/apt_rules.py): the dpkg probe read on what
dpkg-query printed on a Debian 12 node, key fingerprints checked against gpg's, and deb822 sources."""
from __future__ import annotations

import runpy
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_load = runpy.run_path(str(REPO / "ansible" / "plugins" / "module_utils" / "source_tree.py"))["load"]
apt_rules = _load("ansible/plugins/module_utils/apt_rules.py")

# `dpkg-query --show --showformat='${Package}\t${db:Status-Abbrev}\t${Version}\n' chrony sudo nfs-common
# gone half` (sudo held, nfs-common removed with its configuration left, half failed to configure; "gone"
# is unknown, so absent).
PROBE = "chrony\tii \t4.3-2\nsudo\thi \t1.9.13p3-1+deb12u1\nnfs-common\trc \t1:2.6.2-4\nhalf\tiF \t1.0-1\n"


def test_installed_names_are_dropped_and_the_rest_kept_in_order():
    names = ["chrony", "gone", "sudo", "nfs-common", "half"]
    assert apt_rules.packages_not_installed(names, PROBE) == ["gone", "nfs-common", "half"]


def test_everything_installed_leaves_nothing_for_apt():
    assert apt_rules.packages_not_installed(["chrony", "sudo"], PROBE) == []


def test_a_stripped_line_end_still_reads_as_installed():
    assert apt_rules.packages_not_installed(["chrony"], "chrony\tii") == []
    assert apt_rules.packages_not_installed(["chrony=4.3-2"], "chrony\tii \t4.3-2") == []


@pytest.mark.parametrize("name", ["chrony=4.3-*", "chrony*", "chrony:amd64", "./chrony.deb", "docker-ce=5:24.*",
                                  "chrony>=4.3-2", "chrony=", "chrony=4.3 2"])
def test_names_only_apt_can_match_are_always_left_to_apt(name):
    assert apt_rules.packages_not_installed([name], PROBE + f"{name}\tii \t4.3-2\n") == [name]
    assert name not in apt_rules.probe_names([name])


def test_a_pin_at_the_installed_version_leaves_nothing_for_apt():
    # Held or not: a held package at its pinned version needs nothing from apt either.
    assert apt_rules.packages_not_installed(["chrony=4.3-2", "sudo=1.9.13p3-1+deb12u1"], PROBE) == []


@pytest.mark.parametrize("name", ["chrony=4.3-3", "chrony=4.3", "sudo=1.9.15p5-1", "nfs-common=1:2.6.2-4",
                                  "half=1.0-1", "gone=1.0"])
def test_a_pin_to_another_version_or_an_uninstalled_package_goes_to_apt(name):
    assert apt_rules.packages_not_installed([name], PROBE) == [name]


def test_an_epoch_is_part_of_the_version_dpkg_prints():
    probe = "docker-ce\tii \t5:27.5.1-1~debian.12~bookworm\n"
    assert apt_rules.packages_not_installed(["docker-ce=5:27.5.1-1~debian.12~bookworm"], probe) == []
    assert apt_rules.packages_not_installed(["docker-ce=27.5.1-1~debian.12~bookworm"], probe) == [
        "docker-ce=27.5.1-1~debian.12~bookworm"]


def test_a_pin_holds_only_when_every_installed_architecture_has_that_version():
    probe = "libc6\tii \t2.36-9+deb12u14\nlibc6\tii \t2.36-9+deb12u13\n"
    assert apt_rules.packages_not_installed(["libc6=2.36-9+deb12u14"], probe) == ["libc6=2.36-9+deb12u14"]
    assert apt_rules.packages_not_installed(["libc6"], probe) == []


def test_dpkg_is_asked_about_plain_names_and_the_packages_of_pins_once_each():
    names = ["chrony", "sudo=1.9", "chrony=4.3-2", "xx:amd64", "yy=1.*", "zz"]
    assert apt_rules.probe_names(names) == ["chrony", "sudo", "zz"]


def test_no_probe_output_means_apt_looks_at_everything():
    assert apt_rules.packages_not_installed(["chrony", "sudo=1.9"], "") == ["chrony", "sudo=1.9"]
    assert apt_rules.packages_not_installed(["chrony"], None) == ["chrony"]


def test_the_probe_format_matches_dpkg_query_on_this_machine():
    # dpkg is on every machine this project runs on; the command is the one the action runs.
    out = subprocess.run([*apt_rules.DPKG_QUERY, "dpkg"], capture_output=True, text=True, check=True).stdout
    version = subprocess.run(["dpkg-query", "--show", "--showformat=${Version}", "dpkg"],
                             capture_output=True, text=True, check=True).stdout
    assert apt_rules.packages_not_installed(["dpkg", f"dpkg={version}"], out) == []
    assert apt_rules.packages_not_installed([f"dpkg={version}1"], out) == [f"dpkg={version}1"]


def test_the_probe_command_asks_for_name_status_and_version():
    assert apt_rules.DPKG_QUERY == ["dpkg-query", "--show",
                                    "--showformat=${Package}\\t${db:Status-Abbrev}\\t${Version}\\n"]


# ---- fingerprints, checked against gpg's own reading of the same files

KEYRINGS = sorted(Path("/usr/share/keyrings").glob("debian-archive-*.gpg"))


def gpg_fingerprints(path):
    out = subprocess.run(["gpg", "--show-keys", "--with-colons", str(path)], capture_output=True, text=True,
                         check=True, env={"GNUPGHOME": str(path.parent), "PATH": "/usr/bin:/bin"}).stdout
    return [line.split(":")[9] for line in out.splitlines() if line.startswith("fpr:")]


@pytest.fixture(scope="module")
def made_key(tmp_path_factory):
    """An ed25519 key with a subkey made by gpg here: (armored bytes, [primary, subkey] fingerprints)."""
    if not shutil.which("gpg"):
        pytest.skip("gpg is not installed here")
    home = tmp_path_factory.mktemp("gnupg")
    home.chmod(0o700)
    gpg = ["gpg", "--batch", "--homedir", str(home), "--passphrase", ""]
    subprocess.run([*gpg, "--quick-gen-key", "Test Repo <repo@example.org>", "ed25519", "sign", "never"],
                   check=True, capture_output=True)
    out = subprocess.run([*gpg, "--with-colons", "--list-keys"], check=True, capture_output=True, text=True).stdout
    primary = next(line.split(":")[9] for line in out.splitlines() if line.startswith("fpr:"))
    subprocess.run([*gpg, "--quick-add-key", primary, "cv25519", "encr", "never"], check=True, capture_output=True)
    out = subprocess.run([*gpg, "--with-colons", "--list-keys"], check=True, capture_output=True, text=True).stdout
    fingerprints = [line.split(":")[9] for line in out.splitlines() if line.startswith("fpr:")]
    armored = subprocess.run([*gpg, "--armor", "--export"], check=True, capture_output=True).stdout
    return armored, fingerprints


@pytest.mark.skipif(not KEYRINGS or not shutil.which("gpg"), reason="no Debian keyring or no gpg here")
@pytest.mark.parametrize("keyring", KEYRINGS, ids=lambda p: p.name)
def test_binary_keyrings_give_gpgs_fingerprints(keyring, tmp_path):
    copy = tmp_path / keyring.name
    copy.write_bytes(keyring.read_bytes())
    expected = gpg_fingerprints(copy)
    assert expected
    assert apt_rules.key_fingerprints(keyring.read_bytes()) == expected


def test_an_armored_key_with_a_subkey_gives_both_fingerprints(made_key):
    armored, fingerprints = made_key
    assert len(fingerprints) == 2
    assert apt_rules.key_fingerprints(armored) == fingerprints


def test_armor_headers_and_surrounding_text_are_ignored(made_key):
    armored, fingerprints = made_key
    text = armored.decode().replace("-----\n\n", "-----\nComment: vendor key\nVersion: 1\n\n", 1)
    assert apt_rules.key_fingerprints(("Our key:\n" + text + "\nThanks\n").encode()) == fingerprints


def test_armoring_a_binary_key_gives_a_file_gpg_reads_the_same(tmp_path):
    if not KEYRINGS or not shutil.which("gpg"):
        pytest.skip("no Debian keyring or no gpg here")
    binary = KEYRINGS[0].read_bytes()
    (tmp_path / "key.asc").write_text(apt_rules.armor(binary))
    assert gpg_fingerprints(tmp_path / "key.asc") == apt_rules.key_fingerprints(binary)
    assert apt_rules.key_fingerprints((tmp_path / "key.asc").read_bytes()) == apt_rules.key_fingerprints(binary)


@pytest.mark.parametrize("data, says", [
    (b"<html>404 Not Found</html>", "does not start an OpenPGP packet"),
    (b"-----BEGIN PGP PUBLIC KEY BLOCK-----\n\nAAAA\n", "no complete"),
    (b"-----BEGIN PGP PUBLIC KEY BLOCK-----\n\n!!!!\n-----END PGP PUBLIC KEY BLOCK-----\n", "not valid base64"),
    (b"\x99\x01\x0d\x04", "ends inside a packet"),
    (b"", "no public key packet"),
])
def test_what_is_not_a_key_says_why(data, says):
    with pytest.raises(apt_rules.KeyDataError, match=says):
        apt_rules.key_fingerprints(data)


def test_a_truncated_real_key_is_refused():
    if not KEYRINGS:
        pytest.skip("no Debian keyring here")
    with pytest.raises(apt_rules.KeyDataError):
        apt_rules.key_fingerprints(KEYRINGS[0].read_bytes()[:300])


@pytest.mark.parametrize("given", ["EB69 3B30 35CD 5710 E231  E123 A4B4 6996 3BF8 63CC",
                                   "0xeb693b3035cd5710e231e123a4b469963bf863cc"])
def test_fingerprints_are_compared_in_gpgs_form(given):
    assert apt_rules.fingerprint_problem(given) is None
    assert apt_rules.normalize_fingerprint(given) == "EB693B3035CD5710E231E123A4B469963BF863CC"


@pytest.mark.parametrize("given", ["3BF863CC", "", "EB693B3035CD5710E231E123A4B469963BF863CZ"])
def test_short_or_malformed_fingerprints_are_refused(given):
    assert "not a full fingerprint" in apt_rules.fingerprint_problem(given)


# ---- deb822 sources

def test_a_flat_source_has_no_components_line():
    text = apt_rules.render_source(["https://example.org/repo/"], ["/"], [], [], "/etc/apt/keyrings/x.asc")
    assert text == ("Types: deb\nURIs: https://example.org/repo/\nSuites: /\n"
                    "Signed-By: /etc/apt/keyrings/x.asc\n")


def test_a_full_source_lists_everything_and_its_owner():
    text = apt_rules.render_source(["https://a", "https://b"], ["bookworm"], ["stable", "test"], ["amd64"],
                                  "/etc/apt/keyrings/d.asc", "Managed by us")
    assert text.splitlines() == ["# Managed by us", "Types: deb", "URIs: https://a https://b", "Suites: bookworm",
                                 "Components: stable test", "Architectures: amd64",
                                 "Signed-By: /etc/apt/keyrings/d.asc"]


def test_good_arguments_have_no_problem():
    assert apt_rules.source_problems("cuda", ["https://x/"], ["/"], [], [], "/etc/apt/keyrings/cuda.asc") == []
    assert apt_rules.source_problems("docker", ["https://x"], ["bookworm"], ["stable"], ["amd64"],
                                    "/etc/apt/keyrings/docker.asc") == []


@pytest.mark.parametrize("args, says", [
    (("bad name", ["https://x"], ["/"], [], [], "/k.asc"), "must be a file stem"),
    (("n", [], ["/"], [], [], "/k.asc"), "uris must list"),
    (("n", ["ftp.example.org"], ["/"], [], [], "/k.asc"), "is not an http(s)"),
    (("n", ["https://x"], [], [], [], "/k.asc"), "suites must list"),
    (("n", ["https://x"], ["/"], ["main"], [], "/k.asc"), "takes no components"),
    (("n", ["https://x"], ["bookworm"], [], [], "/k.asc"), "components must list"),
    (("n", ["https://x"], ["book worm"], ["main"], [], "/k.asc"), "holds a space"),
    (("n", ["https://x"], ["/"], [], [], "/etc/apt/keyrings/n.gpg"), "ending in .asc"),
    (("n", ["https://x"], ["/"], [], [], "keys/n.asc"), "absolute path"),
])
def test_bad_arguments_are_named(args, says):
    problems = apt_rules.source_problems(*args)
    assert len(problems) == 1
    assert says in problems[0]
