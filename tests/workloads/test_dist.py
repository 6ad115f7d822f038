"""The distributed runtime's launcher checks."""

from sd3cluster.dist import shared_store_warning


def test_warns_on_rank0_when_restarts_use_the_shared_store():
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3", "RANK": "0"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in shared_store_warning(env)


def test_quiet_without_restarts_with_the_store_unshared_or_off_rank0():
    base = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3", "RANK": "0"}
    assert shared_store_warning({**base, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert shared_store_warning({**base, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    assert shared_store_warning({**base, "RANK": "1"}) is None
    assert shared_store_warning({}) is None
