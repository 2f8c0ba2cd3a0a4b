"""``serving.cost_model.model_costs``: cost features from a ModelConfig,
checked against numbers computed by hand for two published shapes."""

import pytest

from models.config import ModelConfig, get_config
from serving import cost_model as cost_lib

# Llama-3.1-8B: d 4096, 32 blocks, 32 query / 8 KV heads of 128, MLP 14336,
# vocabulary 128256, untied head.
LLAMA_8B = ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                       n_kv_heads=8, head_dim=128, ffn_dim=14336, rope_theta=500000.0,
                       tie_embeddings=False, max_position=131072, eos_token_ids=(128001,))
# Mixtral-8x7B: the same attention, 8 experts of 14336, top 2, vocabulary 32000.
MIXTRAL = ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      head_dim=128, ffn_dim=14336, rope_theta=1e6, tie_embeddings=False,
                      max_position=32768, eos_token_ids=(2,), family="mixtral",
                      num_experts=8, experts_per_token=2)


def test_llama_8b_by_hand():
  c = cost_lib.model_costs(LLAMA_8B, "bfloat16")
  # Per block: q 4096x4096 + k, v 4096x1024 each + o 4096x4096 = 41,943,040;
  # MLP 3 x 4096 x 14336 = 176,160,768; sum 218,103,808; x 32 x 2 FLOPs.
  assert c.gemm_flops_per_row == 13_958_643_712
  assert c.lm_head_flops_per_row == 2 * 4096 * 128256 == 1_050_673_152
  # q.k and p.v: 2 x 2 x 32 heads x 128 per block, 32 blocks.
  assert c.attention_flops_per_pair == 524_288
  # K and V: 2 x 8 x 128 bf16 values per block = 4 KiB, 32 blocks = 128 KiB.
  assert c.kv_bytes_per_token == 131_072
  # Blocks 6,979,321,856 + norms 2 x 4096 x 32 + final norm 4096 + head
  # 525,336,576 = 7,504,924,672 values read per step; the untied embedding
  # adds 525,336,576 to the model (8,030,261,248 parameters: "8B").
  assert c.weight_bytes_per_step == 2 * 7_504_924_672
  assert c.weight_bytes == 2 * 8_030_261_248
  assert c.expert_bytes == 0 and c.windows == (0,) * 32
  assert c.attention_flops(1000) == 1000 * 524_288


def test_mixtral_by_hand():
  c = cost_lib.model_costs(MIXTRAL)        # float32 weights and cache
  # Per block: attention 41,943,040 x 2 FLOPs, router 4096 x 8 x 2, two
  # experts 2 x 176,160,768 x 2: 83,886,080 + 65,536 + 704,643,072 =
  # 788,594,688; 32 blocks.
  assert c.gemm_flops_per_row == 25_235_030_016
  assert c.lm_head_flops_per_row == 2 * 4096 * 32000
  assert c.kv_bytes_per_token == 32 * 2 * 1024 * 4
  # One expert in 32 blocks: 32 x 176,160,768 values.
  assert c.expert_bytes == 4 * 5_637_144_576
  # Per block 41,943,040 + 32,768 + 8 x 176,160,768 + 8192 = 1,451,270,144;
  # x 32 + 4096 + head 131,072,000 = 46,571,720,704 (+ the embedding:
  # 46,702,792,704, Mixtral's "46.7B").
  assert c.weight_bytes_per_step == 4 * 46_571_720_704
  assert c.weight_bytes == 4 * 46_702_792_704


def test_windows_cap_the_keys_a_windowed_block_reads():
  import dataclasses
  cfg = dataclasses.replace(get_config("tiny"), layer_windows=(8, 0))
  c = cost_lib.model_costs(cfg)
  per_block = 4 * cfg.n_heads * cfg.head_dim
  assert c.attention_flops_per_pair == 2 * per_block
  assert c.attention_flops(20) == per_block * (8 + 20)
  assert c.attention_flops(5) == per_block * (5 + 5)
  assert c.to_json()["windows"] == [8, 0]


def test_tied_int8_and_kv_dtypes():
  cfg = get_config("tiny")          # tied: the head is the embedding, counted once
  f32 = cost_lib.model_costs(cfg)
  assert f32.weight_bytes == f32.weight_bytes_per_step
  int8 = cost_lib.model_costs(cfg, "int8")
  assert int8.weight_bytes * 4 == f32.weight_bytes
  assert int8.kv_dtype == "float32" and int8.kv_bytes_per_token == f32.kv_bytes_per_token
  assert cost_lib.model_costs(cfg, kv_dtype="bfloat16").kv_bytes_per_token * 2 == (
      f32.kv_bytes_per_token)
  with pytest.raises(ValueError, match="weight_dtype must be one of"):
    cost_lib.model_costs(cfg, "float8")
