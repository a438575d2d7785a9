"""Every public member of vLLM's ``KVCacheManager`` is overridden by kvbackend's
manager or inherited on purpose, as the table in ``kvbackend/vllm/manager.py`` says.

A vLLM upgrade that adds a public method fails here until someone has checked
what it does under kvbackend and added it to the table.
"""

from __future__ import annotations

import inspect
import re

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402

from kvbackend.vllm import manager  # noqa: E402

ROW = re.compile(r"^    (\w+)\s+(overridden|inherited)\s", re.MULTILINE)


def public_members(cls) -> set[str]:
    """Public methods and properties ``cls`` defines or inherits (not from object)."""
    return {name for name, member in inspect.getmembers(cls)
            if not name.startswith("_")
            and (inspect.isfunction(member) or isinstance(member, property))}


def surface_table() -> dict[str, str]:
    rows = ROW.findall(manager.__doc__)
    table = dict(rows)
    assert len(table) == len(rows), "a member is listed twice"
    return table


def test_every_public_member_of_vllms_manager_is_in_the_table():
    table = surface_table()
    unchecked = public_members(KVCacheManager) - set(table)
    assert not unchecked, f"vLLM's KVCacheManager has members kvbackend has not checked: " \
                          f"{sorted(unchecked)}; add each to the table in manager.py"
    gone = set(table) - public_members(KVCacheManager)
    assert not gone, f"the table names members vLLM no longer has: {sorted(gone)}"


def test_the_table_says_which_members_are_overridden():
    ours = vars(manager.KVBackendManager)
    wrong = {name: kind for name, kind in surface_table().items()
             if (name in ours) != (kind == "overridden")}
    assert not wrong, f"the table is wrong about these members: {wrong}"


def test_every_method_kvbackends_schedulers_override_is_still_vllms():
    """kvbackend's schedulers override some of vLLM's private scheduler methods
    (``_handle_invalid_blocks``, ``_request_remaining_blocks``): a vLLM upgrade that
    renames one, or changes its parameters, would leave the override silently unused."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvbackend.vllm.scheduler import KVBackendAsyncScheduler, KVBackendScheduler

    for ours, theirs in ((KVBackendScheduler, Scheduler),
                         (KVBackendAsyncScheduler, AsyncScheduler)):
        for name, method in vars(ours).items():
            if not inspect.isfunction(method) or name.startswith("__"):
                continue
            assert hasattr(theirs, name), f"vLLM's scheduler has no {name} any more"
            vllm_params = list(inspect.signature(getattr(theirs, name)).parameters)
            our_params = list(inspect.signature(method).parameters)
            assert our_params == vllm_params or our_params == ["self", "args", "kwargs"], (
                f"{name}: vLLM's parameters are {vllm_params}, kvbackend's {our_params}")
