"""agent.host: the boot ID the health and state modules compare across restarts."""

from __future__ import annotations

import pytest

from agent import host
from agent.errors import AgentError


def test_the_kernels_boot_id_is_a_uuid():
    value = host.boot_id({})
    assert len(value) == 36 and value.count("-") == 4


def test_the_env_var_points_at_another_file(tmp_path):
    f = tmp_path / "boot_id"
    f.write_text("11111111-2222-3333-4444-555555555555\n")
    assert host.boot_id({host.BOOT_ID_ENV: str(f)}) == "11111111-2222-3333-4444-555555555555"


@pytest.mark.parametrize("content", [None, ""], ids=["missing", "empty"])
def test_an_unreadable_boot_id_names_the_file(tmp_path, content):
    f = tmp_path / "boot_id"
    if content is not None:
        f.write_text(content)
    with pytest.raises(AgentError, match=str(f)):
        host.boot_id({host.BOOT_ID_ENV: str(f)})
