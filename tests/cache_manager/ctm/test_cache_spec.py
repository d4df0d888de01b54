"""The CTM rebuilds, from its flags, exactly the cache spec the engine allocated from."""
import pytest

from cache_manager.ctm_flags import parse_args, spec_from_args
from engine_hooks import CacheSpec, CacheTransferService

SPECS = [
    CacheSpec(num_layers=2, num_blocks=16, kv_heads=2, block_size=4, head_dim=8),
    CacheSpec(num_layers=3, num_blocks=10, kv_heads=1, block_size=8, head_dim=16, cache_dtype="block_wise_fp8",
              default_dtype="float16", num_extra_layers=1, extra_block_ratio=1.5),
    CacheSpec(num_layers=1, num_blocks=4, kv_heads=4, block_size=2, head_dim=32, cache_dtype="uint8", mla=True),
    CacheSpec(num_layers=2, num_blocks=8, kv_heads=2, block_size=4, head_dim=8, value_block_shape=(2, 4, 16)),
]


@pytest.mark.parametrize("spec", SPECS)
def test_flags_round_trip_to_the_same_spec_and_namespace(spec, tmp_path):
    svc = CacheTransferService(spec, tp=2, model_id="org/m", model_version="v3", cache_queue_port=9,
                                log_dir=str(tmp_path))
    flags = svc.ctm_flags(1)
    args = parse_args([x for k, v in flags.items() for x in (f"--{k}", str(v))])
    assert spec_from_args(args) == spec
    assert spec_from_args(args).storage_namespace(args.model_path, args.model_version, args.mp_num) == svc.namespace()
    assert spec_from_args(args).kinds() == spec.kinds()
