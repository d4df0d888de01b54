"""The cache layout every path works on (``cache_manager.cache_layout``): FastDeploy's flags give
exactly today's caches, IPC names and storage keys; a grouped layout is checked field by field,
names its own storage namespace, and travels as ``--cache_layout`` JSON."""
from __future__ import annotations

import json

import pytest

from cache_manager.cache_data import cache_name
from cache_manager.cache_layout import CacheLayout, TensorGroup, load_layout
from cache_manager.cache_presets import PRESETS, preset
from cache_manager.cache_spec import CacheSpec
from cache_manager.ctm_flags import layout_from_args, parse_args
from transfer_factory.keys import storage_key

DENSE = CacheSpec(num_layers=3, num_blocks=64, kv_heads=2, block_size=64, head_dim=128)
MLA_FP8_MTP = CacheSpec(num_layers=2, num_blocks=32, kv_heads=1, block_size=16, head_dim=576, mla=True,
                        cache_dtype="block_wise_fp8", num_extra_layers=1)


@pytest.mark.parametrize("spec,namespace", [(DENSE, "model-7B-tp2-60675b5068138e94"),
                                            (MLA_FP8_MTP, "model-7B-tp2-59f59ddb7bc8c962")])
def test_fastdeploy_flags_keep_todays_caches_ipc_names_and_storage_keys(spec, namespace):
    # the namespaces are what the code before grouped layouts printed for these specs
    layout = spec.layout()
    assert str(layout.storage_namespace("org/model-7B", "RL-STEP3", 2)) == namespace
    assert [(g.name, list(g.block_shape), g.dtype) for g in layout.groups] == \
        [(k, s, d) for k, s, d in spec.kinds()]
    assert all(list(g.layers) == list(range(spec.num_layers + spec.num_extra_layers)) for g in layout.groups)
    assert [g.tag for g in layout.groups] == (["k", "v"] if spec is DENSE else ["k", "k_scale"])
    assert cache_name(layout.groups[0].name, 2, 1, 1) == "key_caches_2_rank1.device1"
    assert storage_key(namespace, "ab" * 32, 1, layout.groups[0].tag).endswith("/1/k")

    argv = ["--cache_queue_port", "1", "--engine_worker_queue_port", "2", "--num_layers", str(spec.num_layers),
            "--key_cache_shape", ",".join(map(str, spec.cache_shape)), "--cache_dtype", spec.cache_dtype,
            "--value_cache_shape", ",".join(map(str, spec.value_cache_shape))]
    if spec.num_extra_layers:
        argv += ["--speculative_config", json.dumps(spec.speculative_config())]
    assert layout_from_args(parse_args(argv)) == layout


def test_a_grouped_layout_round_trips_as_json_text_and_file_and_names_its_own_namespace(tmp_path):
    layout = preset("glm-5", num_blocks=8, layers=2, dim_scale=8)
    text = json.dumps(layout.to_json())
    assert load_layout(text) == layout
    (tmp_path / "glm5.json").write_text(text)
    args = parse_args(["--cache_queue_port", "1", "--engine_worker_queue_port", "2",
                       "--cache_layout", str(tmp_path / "glm5.json")])
    assert layout_from_args(args) == layout and args.num_layers == 2
    namespaces = {str(preset(name, 8, 2, 8).storage_namespace("m", "", 1)) for name in PRESETS}
    assert len(namespaces) == len(PRESETS)  # two layouts never share a key
    assert str(layout.storage_namespace("m", "", 1)) != str(preset("glm-5", 8, 2, 16).storage_namespace("m", "", 1))
    assert layout.digest() == preset("glm-5", num_blocks=512, layers=2, dim_scale=8).digest()  # capacity is not meaning


@pytest.mark.parametrize("change,message", [
    (lambda j: j["groups"][0].update(layers=[0, 5]), "cache group 'latent_caches' has layer 5, the model has 2"),
    (lambda j: j["groups"][0].update(kind="paged"), "kind 'paged' must be one of"),
    (lambda j: j["groups"][0].update(tp="sharded"), "tp 'sharded' must be one of"),
    (lambda j: j["groups"][1].update(name="latent_caches"), "cache group 'latent_caches' is listed twice"),
    (lambda j: j["groups"][0].update(compress=3), "compress 3 does not divide block_size 128"),
    (lambda j: j["groups"][0].update(block_shape=[1, 0]), "block_shape \\[1, 0\\] must be a list of positive"),
    (lambda j: j["groups"][0].update(dtype="float64"), "dtype 'float64'"),
    (lambda j: j["groups"][0].update(window=64), "window 64 is only for kind sliding_window"),
    (lambda j: j["groups"][0].update(colour="red"), "unknown field 'colour'"),
    (lambda j: j.update(groups=[j["groups"][0] | {"layers": [1]}]), "layer 0 has no cache group"),
    (lambda j: j.pop("block_size"), "field 'block_size' is missing"),
])
def test_a_bad_layout_is_refused_naming_the_group_and_field(change, message):
    value = preset("glm-5", num_blocks=8, layers=2, dim_scale=8).to_json()
    change(value)
    with pytest.raises(ValueError, match=message):
        CacheLayout.from_json(value)
    with pytest.raises(SystemExit):
        parse_args(["--cache_queue_port", "1", "--engine_worker_queue_port", "2", "--cache_layout", json.dumps(value)])


def test_a_ctm_needs_a_cache_description():
    with pytest.raises(SystemExit):
        parse_args(["--cache_queue_port", "1", "--engine_worker_queue_port", "2"])


def test_presets_keep_the_models_block_sizes_and_ratios():
    v3 = preset("deepseek-v3")
    assert {g.name: g.block_bytes for g in v3.groups} == {"latent_caches": 128 << 10, "rope_caches": 16 << 10}
    assert v3.total_layers == 62 and v3.num_extra_layers == 1 and {g.tp for g in v3.groups} == {"replicated"}
    assert {g.name: g.block_bytes for g in preset("glm-5").groups}["indexer_caches"] == 32 << 10
    v4 = {g.name: g for g in preset("deepseek-v4").groups}
    assert (len(v4["c128_caches"].layers), len(v4["c4_caches"].layers)) == (31, 30)
    assert v4["window_caches"].window_blocks(128) == 2 and v4["c4_caches"].compress == 4
    nxt = preset("qwen3-next", tp=1)
    assert [g.name for g in nxt.groups if g.per_request] == ["conv_state", "ssm_state"]
    assert len(nxt.groups[0].layers) * 4 == nxt.total_layers
    assert preset("qwen3-235b", tp=8).groups[0].block_shape[0] == 1  # 4 kv heads over 8 ranks: one each
    with pytest.raises(ValueError, match="preset 'llama' is not one of"):
        preset("llama")
    assert TensorGroup("key_caches", "bfloat16", (2, 4, 8), (0,)).tag == "k"
