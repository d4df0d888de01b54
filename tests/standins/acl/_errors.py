"""aclError codes of the pyACL stand-in (tests only).

Values follow CANN's ``acl_base.h`` (1000xx: errors found by the ACL layer's argument checks)
and ``rt_error_codes.h`` (107xxx: runtime parameter errors, 207xxx: resource / feature errors,
507xxx: runtime internal errors), as best known from the published headers; the real runtime
may return a different code than the stand-in picks for a case its documentation leaves open.
Which code each check of the stand-in returns is listed in ``acl.__doc__``.
"""
from __future__ import annotations

ACL_SUCCESS = 0

# acl_base.h
ACL_ERROR_INVALID_PARAM = 100000
ACL_ERROR_UNINITIALIZE = 100001
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_ERROR_INVALID_FILE = 100003
ACL_ERROR_REPEAT_FINALIZE = 100037

# rt_error_codes.h
ACL_ERROR_RT_PARAM_INVALID = 107000
ACL_ERROR_RT_INVALID_DEVICEID = 107001
ACL_ERROR_RT_CONTEXT_NULL = 107002
ACL_ERROR_RT_STREAM_CONTEXT = 107003
ACL_ERROR_RT_ADDR_UNALIGNED = 107008
ACL_ERROR_RT_INVALID_MEMORY_TYPE = 107016
ACL_ERROR_RT_INVALID_HANDLE = 107017
ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000
ACL_ERROR_RT_MEMORY_ALLOCATION = 207001
ACL_ERROR_RT_MEMORY_FREE = 207002
ACL_ERROR_RT_NO_PERMISSION = 207006
ACL_ERROR_RT_INTERNAL_ERROR = 507000
ACL_ERROR_RT_IPC_ERROR = 507022

# aclrtMemcpyBatchAsync's failIndex when the error concerns no single copy (SIZE_MAX)
SIZE_MAX = (1 << 64) - 1

ERROR_CODES = {name: value for name, value in dict(globals()).items() if name.startswith("ACL_")}
__all__ = [*ERROR_CODES, "ERROR_CODES", "SIZE_MAX"]
