"""ContextCaching V1 of the EMS contract stand-in (tests only; not the Huawei SDK).

Deliberately re-exports nothing: the SDK documents ``KVCacheType`` at ``ems.cc_v1.cc_config`` and
the rest at ``ems``, so code under test must import them from there.
"""
