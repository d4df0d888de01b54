"""Contract stand-in for the Huawei EMS Python SDK (ContextCaching V1), for tests only.

The real SDK cannot be installed here.  This package is importable as ``ems`` only when a test
puts ``tests/standins`` on ``sys.path``; it mirrors the documented API (``Ems``, ``EmsConfig``,
``CcConfig_v1``, ``CcKvOption``, ``CcResult``, ``EmsException``, ``EmsErrorCode``,
``ems.cc_v1.cc_config.KVCacheType``) and rejects with ``EmsException(EMS_INVALID_ARGUMENT)`` what
the SDK documents as invalid, so code that passes against it is likely to run on the real SDK.

Differences from the real SDK, by necessity: it takes host-addressable tensors (paddle CPU
tensors or anything with ``data_ptr()``, ``shape``, ``element_size()``) instead of NPU tensors and
reads/writes them through ``data_ptr()`` with ctypes; blocks are files under
``$EMS_STANDIN_DIR/data/<model_id>/tp<tp_world_size>/rank<rank_in_tp_group>/<hash:016x>``;
``$EMS_STANDIN_DIR/faults.json`` injects faults and ``$EMS_STANDIN_DIR/calls.log`` counts calls
(see ``ems.faults``).  ``Ems._reset()`` exists for tests only.  Only the documented names are
exported here (``KVCacheType`` only from ``ems.cc_v1.cc_config``), so an undocumented import fails.
"""
from .cc_v1.cc_config import CcConfig_v1
from .cc_v1.context_cache import ContextCache_v1
from .client import Ems, EmsConfig
from .errors import EmsErrorCode, EmsException
from .options import CcKvOption, CcResult

__all__ = ["CcConfig_v1", "CcKvOption", "CcResult", "ContextCache_v1", "Ems", "EmsConfig", "EmsErrorCode",
           "EmsException"]
