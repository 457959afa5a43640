"""agent.health.policy: NVIDIA's DP_DISABLE_HEALTHCHECKS / DP_ENABLE_HEALTHCHECKS semantics
(the cases of NVIDIA's own TestNewHealthCheckXIDs / TestGetDisabledHealthCheckXids, answered
the same way), the XID classes over them, what the C filter is given, and the config options
that carry them (flag, env var, file key).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.config import load_config
from agent.constants import XID_ACTIONS
from agent.errors import ConfigError
from agent.health import policy
from agent.health.policy import (
    APPLICATION,
    IGNORE,
    REBOOT,
    RESET,
    XidPolicy,
    nvidia_all_disabled,
    nvidia_disabled_xids,
    nvidia_is_disabled,
    parse_xid_list,
)

DEFAULT = {13: True, 31: True, 43: True, 45: True, 68: True, 109: True}


@pytest.mark.parametrize("text, expected", [
    ("", {}), (",", {}), ("not-an-int", {}), ("68", {68: True}), ("-68", {}),
    ("68  ", {68: True}), ("68,", {68: True}), (",68", {68: True}),
    ("68,67", {67: True, 68: True}), ("68,not-an-int,67", {67: True, 68: True}),
    ("all", {0: True}), ("48,XIDS", {0: True}), ("ALL,48", {0: True}),
])
def test_xid_lists_parse_as_nvidia_parses_them(text, expected):
    assert parse_xid_list(text, "DP_DISABLE_HEALTHCHECKS") == expected


def test_a_malformed_xid_is_skipped_with_a_warning_naming_the_variable(caplog):
    assert parse_xid_list("48,4x8", "DP_ENABLE_HEALTHCHECKS") == {48: True}
    assert "DP_ENABLE_HEALTHCHECKS: ignoring malformed XID '4x8'" in caplog.text


# (disable, enable, all disabled, {xid: disabled}) — NVIDIA's TestGetDisabledHealthCheckXids.
NVIDIA_CASES = [
    ("", "", False, {**DEFAULT, 555: False}),
    ("all", "", True, {**DEFAULT, 555: True}),
    ("xids", "", True, {**DEFAULT, 555: True}),
    ("", "all", False, {13: False, 31: False, 43: False, 45: False, 68: False, 109: False,
                        555: False}),
    ("11", "11", False, {11: False, **DEFAULT, 555: False}),
    ("", "31", False, {**DEFAULT, 31: False, 555: False}),
]


@pytest.mark.parametrize("disable, enable, all_disabled, expected", NVIDIA_CASES,
                         ids=["empty", "disable-all", "disable-xids", "enable-all",
                              "enable-overrides-disable", "enable-overrides-default"])
def test_disabled_xids_as_nvidia(disable, enable, all_disabled, expected):
    disabled = nvidia_disabled_xids(disable, enable)
    assert nvidia_all_disabled(disabled) is all_disabled
    assert {x: nvidia_is_disabled(disabled, x) for x in expected} == expected


@pytest.mark.parametrize("disable, enable, all_disabled, expected", NVIDIA_CASES,
                         ids=["empty", "disable-all", "disable-xids", "enable-all",
                              "enable-overrides-disable", "enable-overrides-default"])
def test_policy_withdraws_exactly_where_nvidia_marks_unhealthy(disable, enable, all_disabled,
                                                               expected):
    p = XidPolicy.build(disable, enable)
    assert p.enabled is not all_disabled
    if p.enabled:
        for xid, disabled in expected.items():
            assert (p.action(xid) in policy.WITHDRAWING) is not disabled, xid
            assert (xid in p.filtered_xids()) is disabled, xid


def test_disable_all_with_single_xids_enabled_still_turns_checks_off_as_nvidia_does():
    """NVIDIA's IsAllDisabled looks only at the "all" key: enabling 48 does not bring it back."""
    assert not XidPolicy.build("all", "48").enabled
    assert XidPolicy.build("all", "all").enabled
    assert not XidPolicy.build("0", "").enabled  # NVIDIA's "all" key is XID 0


def test_classes_follow_the_catalog_and_config_overrides():
    p = XidPolicy.build()
    assert [p.action(x) for x in (13, 31, 48, 79, 94, 999)] == \
        [APPLICATION, APPLICATION, RESET, REBOOT, RESET, RESET]
    p = XidPolicy.build(overrides=[(79, "reset"), (48, "ignore"), (13, "reboot")])
    assert [p.action(x) for x in (79, 48, 13)] == [RESET, IGNORE, REBOOT]
    assert 48 in p.filtered_xids() and 13 not in p.filtered_xids()
    # DP_ENABLE forces an ignored class to withdraw; DP_DISABLE forces a withdrawing one off
    p = XidPolicy.build("79", "48", overrides=[(48, "ignore")])
    assert p.action(48) == RESET and p.action(79) == IGNORE
    assert p.event_action(0x8, 48) == (RESET, "XID 48 (double-bit ECC error): GPU reset required")


# NVIDIA's XID catalog, "Resolution Bucket (Immediate Action)"
# (https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html; rows 1-13 read on the
# page, the rest in copies of it: gpud's components/accelerator/nvidia/xid/catalog_generated.go
# generated from it on 2025-10-29).
CATALOG_CASES = [(13, "RESTART_APP", APPLICATION), (31, "RESTART_APP", APPLICATION),
                 (43, "IGNORE", IGNORE), (45, "WORKFLOW_XID_45", APPLICATION),
                 (48, "WORKFLOW_XID_48", RESET), (63, "IGNORE", IGNORE),
                 (74, "WORKFLOW_NVLINK_ERR", RESET), (79, "RESTART_BM", REBOOT),
                 (92, "IGNORE", IGNORE), (94, "RESTART_APP", APPLICATION),
                 (95, "RESET_GPU", RESET), (109, "RESET_GPU", RESET), (119, "RESET_GPU", RESET),
                 (145, "WORKFLOW_NVLINK5_ERR", RESET), (151, "RESTART_VM", REBOOT),
                 (160, "IGNORE", IGNORE), (1, "CONTACT_SUPPORT", RESET),
                 (142, "CONTACT_SUPPORT", RESET), (154, "XID_154", RESET)]


@pytest.mark.parametrize("xid, bucket, action", CATALOG_CASES, ids=[str(c[0]) for c in CATALOG_CASES])
def test_the_catalog_table_gives_each_xid_the_class_of_its_immediate_action(xid, bucket, action):
    p = XidPolicy.build(table="catalog")
    assert p.action(xid) == action
    assert f"catalog: {bucket}" in p.describe(xid)


def test_the_catalog_table_covers_every_xid_it_lists_and_withdraws_the_rest():
    p = XidPolicy.build(table="catalog")
    assert sorted(policy.CATALOG_XID_ACTIONS) == list(range(1, 162))
    assert p.action(999) == RESET and p.action(162) == RESET and p.describe(162) == ""
    assert XidPolicy.build().table == "nvidia"  # NVIDIA's stays the default


def test_overrides_and_nvidia_switches_apply_on_top_of_the_catalog_table():
    p = XidPolicy.build("109", "94", overrides=[(79, "reset")], table="catalog")
    assert p.action(109) == IGNORE  # DP_DISABLE_HEALTHCHECKS
    assert p.action(94) == RESET  # DP_ENABLE_HEALTHCHECKS: an application XID withdraws
    assert p.action(79) == RESET  # xidActions
    assert 63 in p.filtered_xids() and 109 in p.filtered_xids() and 94 not in p.filtered_xids()
    # XID 154 under the catalog: reset class, unless the driver asks for a reboot
    c = XidPolicy.build(table="catalog")
    assert [c.event_action(0x8, 154, a)[0] for a in (None, 1, 2)] == [RESET, RESET, REBOOT]


def test_an_unknown_table_is_refused():
    with pytest.raises(ValueError, match="unknown XID table 'dcgm'"):
        XidPolicy.build(table="dcgm")


def test_event_actions_name_the_xid_and_what_to_do():
    p = XidPolicy.build()
    assert p.event_action(0x8, 79) == (REBOOT, "XID 79 (GPU has fallen off the bus): node "
                                               "reboot required")
    assert p.event_action(0x2, 0)[0] == RESET
    assert p.event_action(0x4, 0)[0] == IGNORE


def test_xid_154_takes_its_class_from_the_recovery_action_the_driver_reports_now():
    p = XidPolicy.build()
    # NVML_GPU_RECOVERY_ACTION_*: 0 none, 1 GPU reset, 2 node reboot, 4 drain and reset, 7 system
    assert [p.event_action(0x8, 154, a)[0] for a in (0, 1, 2, 4, 7)] == \
        [RESET, RESET, REBOOT, RESET, REBOOT]
    assert p.event_action(0x8, 154, 1)[1] == \
        "XID 154 (GPU recovery action changed, now 1): GPU reset required"
    assert p.event_action(0x8, 154) == p.event_action(0x8, 154, None) == \
        (REBOOT, "XID 154 (GPU recovery action changed): node reboot required")  # not read
    assert p.event_action(0x8, 48, 2)[0] == RESET  # only XID 154 asks the driver
    # an operator who turned XID 154 off keeps it off whatever the driver says
    assert XidPolicy.build("154").event_action(0x8, 154, 2)[0] == IGNORE
    assert XidPolicy.build(overrides=[(154, "ignore")]).event_action(0x8, 154, 2)[0] == IGNORE


def test_xids_beyond_the_filter_are_decided_in_python():
    p = XidPolicy.build("5000")
    assert max(p.filtered_xids()) < 1024
    assert p.action(5000) == IGNORE and p.action(5001) == RESET


def test_action_classes_run_weakest_first():
    # agent.health.recovery.STRENGTH ranks faults by this order
    assert XID_ACTIONS == (IGNORE, APPLICATION, RESET, REBOOT)


@given(st.text(alphabet="0123456789,axlids -", max_size=20),
       st.text(alphabet="0123456789,axlids -", max_size=20),
       st.integers(0, 1500))
def test_property_policy_matches_nvidia_for_any_lists(disable, enable, xid):
    disabled = nvidia_disabled_xids(disable, enable)
    p = XidPolicy.build(disable, enable)
    assert p.enabled is not nvidia_all_disabled(disabled)
    if p.enabled:
        assert (p.action(xid) in policy.WITHDRAWING) is not nvidia_is_disabled(disabled, xid)


# -- the options ------------------------------------------------------------------------------


def test_health_options_from_env_flag_and_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("version: v1\nagent:\n  health:\n    xidActions: {79: reset, '48': ignore}\n"
                    "    disableHealthchecks: [48, 63]\n    recoveryQuietPeriod: 2m\n"
                    "    unhealthyDevicesFile: /srv/iso.json\n")
    cfg = load_config({"config_file": str(path)}, {"DP_ENABLE_HEALTHCHECKS": "13"})
    assert cfg.xid_actions == ((48, "ignore"), (79, "reset"))
    assert cfg.disable_healthchecks == "48,63" and cfg.enable_healthchecks == "13"
    assert cfg.recovery_quiet_period == 120.0
    assert cfg.unhealthy_devices_file == "/srv/iso.json"
    cfg = load_config({"config_file": str(path), "xid_actions": "13=reboot",
                       "disable_healthchecks": "all"}, {})
    assert cfg.xid_actions == ((13, "reboot"),) and cfg.disable_healthchecks == "all"
    assert load_config({}, {"GPU_AGENT_XID_POLICY": "catalog"}).xid_policy == "catalog"
    defaults = load_config({}, {})
    assert defaults.xid_policy == "nvidia"
    assert defaults.unhealthy_devices_file == "/etc/nvidia-device-plugin/unhealthyDevices.json"
    assert defaults.recovery_quiet_period == 60.0 and defaults.xid_actions == ()


@pytest.mark.parametrize("doc, key, problem", [
    ("xidActions: {48: isolate}", "agent.health.xidActions.48",
     "string 'isolate' is not one of ignore, application, reset, reboot"),
    ("xidActions: [48]", "agent.health.xidActions", "expected a mapping of XID to action"),
    ("xidActions: {-1: reset}", "agent.health.xidActions.-1", "integer -1 is not an XID"),
    ("recoveryQuietPeriod: soon", "agent.health.recoveryQuietPeriod",
     "'soon' is not a duration"),
    ("unhealthyDevicesFile: iso.json", "agent.health.unhealthyDevicesFile",
     "'iso.json' is not an absolute path"),
    ("disableHealthchecks: [true]", "agent.health.disableHealthchecks[0]",
     "expected an XID, got boolean true"),
    ("xidPolicy: dcgm", "agent.health.xidPolicy", "'dcgm' is not one of nvidia, catalog"),
])
def test_bad_health_values_name_the_key_and_file(tmp_path, doc, key, problem):
    path = tmp_path / "c.yaml"
    path.write_text(f"version: v1\nagent:\n  health:\n    {doc}\n")
    with pytest.raises(ConfigError) as info:
        load_config({"config_file": str(path)}, {})
    assert info.value.key == key and info.value.source == str(path)
    assert info.value.problem.startswith(problem)


def test_bad_xid_actions_in_the_environment_name_the_variable():
    with pytest.raises(ConfigError) as info:
        load_config({}, {"GPU_AGENT_XID_ACTIONS": "48:reset"})
    assert info.value.key == "GPU_AGENT_XID_ACTIONS"
    assert "'48:reset' is not XID=ACTION" in info.value.problem


def test_the_status_sample_in_health_md_shows_the_default_policy_as_it_is():
    # docs/health.md's `gpu-agent status` sample once said 1018 ignored XIDs for NVIDIA's table
    from pathlib import Path

    docs = (Path(__file__).resolve().parent.parent / "docs" / "health.md").read_text()
    line = f"health: on (cython; {XidPolicy.build().summary()}); recovery quiet period 60 s"
    assert line in docs.splitlines()
