// config.json parsing (both transformers layouts, defaults, rejections) and RoPE frequencies.
#include <cmath>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "core/error.h"
#include "trainer/model/hf_config.h"

using dflash::UserError;
using dflash::model::parse_hf_config;

namespace {
std::string err(const std::string& text) {
  try {
    parse_hf_config(text, "x/config.json");
  } catch (const UserError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no UserError for " << text;
  return "";
}
}  // namespace

TEST(HfConfig, Transformers4LlamaLayout) {
  // A Llama-3.1-8B-Instruct style config (transformers 4: top-level rope_theta, rope_scaling).
  auto c = parse_hf_config(R"({"architectures":["LlamaForCausalLM"],"model_type":"llama",
    "hidden_size":4096,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,
    "intermediate_size":14336,"vocab_size":128256,"rms_norm_eps":1e-05,"rope_theta":500000.0,
    "rope_scaling":{"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
    "original_max_position_embeddings":8192,"rope_type":"llama3"},"bos_token_id":128000,
    "eos_token_id":[128001,128008,128009],"tie_word_embeddings":false,"max_position_embeddings":131072,
    "torch_dtype":"bfloat16","mlp_bias":false,"attention_bias":false,"pretraining_tp":1})", "c");
  EXPECT_EQ(c.model_type, "llama");
  EXPECT_EQ(c.head_dim, 128);  // hidden / heads when absent
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.rope.type, "llama3");
  EXPECT_DOUBLE_EQ(c.rope.theta, 500000.0);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 8192);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{128001, 128008, 128009}));
  EXPECT_EQ(*c.bos_token_id, 128000);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
}

TEST(HfConfig, Transformers5QwenLayoutAndDefaults) {
  auto c = parse_hf_config(R"({"model_type":"qwen3","hidden_size":2560,"num_hidden_layers":36,
    "num_attention_heads":32,"num_key_value_heads":8,"intermediate_size":9728,"vocab_size":151936,
    "rope_parameters":{"rope_theta":1000000.0,"rope_type":"default"},"tie_word_embeddings":true,
    "eos_token_id":151645,"bos_token_id":null,"layer_types":["full_attention"]})", "c");
  EXPECT_EQ(c.head_dim, 128);  // Qwen3Config's default, not hidden / heads (80)
  EXPECT_TRUE(c.qk_norm);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);
  EXPECT_EQ(c.rope.type, "default");
  EXPECT_FALSE(c.bos_token_id.has_value());
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{151645}));
  EXPECT_EQ(c.q_dim(), 4096);
  EXPECT_EQ(c.kv_dim(), 1024);
}

TEST(HfConfig, Rejections) {
  const std::string base = R"("hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,"intermediate_size":96,"vocab_size":100)";
  EXPECT_NE(err("{\"model_type\":\"mistral\"," + base + "}").find("'mistral'"), std::string::npos);
  EXPECT_NE(err("{" + base + "}").find("model_type"), std::string::npos);
  EXPECT_NE(err(R"({"model_type":"qwen3","architectures":["Qwen2ForCausalLM"],)" + base + "}")
                .find("Qwen2ForCausalLM"), std::string::npos);
  EXPECT_NE(err(R"({"model_type":"llama","rope_scaling":{"type":"yarn","factor":2.0},)" + base + "}")
                .find("'yarn'"), std::string::npos);
  EXPECT_NE(err(R"({"model_type":"llama","num_key_value_heads":3,)" + base + "}").find("multiple"),
            std::string::npos);
  EXPECT_NE(err(R"({"model_type":"llama","attention_bias":true,)" + base + "}").find("attention_bias"),
            std::string::npos);
  EXPECT_NE(err(R"({"model_type":"qwen3","use_sliding_window":true,)" + base + "}").find("sliding"),
            std::string::npos);
  EXPECT_NE(err(R"({"model_type":"llama","hidden_size":"64"})").find("'hidden_size'"), std::string::npos);
  EXPECT_NE(err(R"({"model_type":"llama","num_hidden_layers":2})").find("'hidden_size' is missing"),
            std::string::npos);
  EXPECT_NE(err("{\"model_type\":\"llama\"," + base + ",}").find("x/config.json"), std::string::npos);
}

TEST(HfConfig, Llama3RopeFrequencies) {
  // Written out from the Llama 3.1 reference formula, independently of rope_inv_freq's code.
  auto c = parse_hf_config(R"({"model_type":"llama","hidden_size":256,"num_hidden_layers":1,
    "num_attention_heads":2,"intermediate_size":8,"vocab_size":8,"rope_parameters":{"rope_type":"llama3",
    "rope_theta":500000.0,"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
    "original_max_position_embeddings":8192}})", "c");
  at::Tensor got = dflash::model::rope_inv_freq(c);
  ASSERT_EQ(got.numel(), 64);
  for (int i = 0; i < 64; ++i) {
    double f = 1.0 / std::pow(500000.0, 2.0 * i / 128.0);
    double wl = 2 * M_PI / f, lo = 8192.0 / 1.0, hi = 8192.0 / 4.0, want;
    if (wl < hi) want = f;
    else if (wl > lo) want = f / 8.0;
    else {
      double s = (8192.0 / wl - 1.0) / (4.0 - 1.0);
      want = (1 - s) * f / 8.0 + s * f;
    }
    EXPECT_NEAR(got[i].item<double>(), want, 1e-6 * want) << i;
  }
}

#include "trainer/model/target.h"

TEST(TargetSettings, DefaultLayerIds) {
  using dflash::model::default_layer_ids;
  // DFLASH.md §1.1's table.
  EXPECT_EQ(default_layer_ids(36, 5), (std::vector<int64_t>{1, 9, 17, 25, 33}));
  EXPECT_EQ(default_layer_ids(32, 5), (std::vector<int64_t>{1, 8, 15, 22, 29}));
  EXPECT_EQ(default_layer_ids(64, 5), (std::vector<int64_t>{1, 16, 31, 46, 61}));
  EXPECT_EQ(default_layer_ids(48, 5), (std::vector<int64_t>{1, 12, 23, 34, 45}));
  EXPECT_EQ(default_layer_ids(36, 1), (std::vector<int64_t>{18}));
  // 1 + 6.5 i: Python's round(7.5) = 8, round(20.5) = 20.
  EXPECT_EQ(default_layer_ids(30, 5), (std::vector<int64_t>{1, 8, 14, 20, 27}));
  EXPECT_THROW(default_layer_ids(4, 5), UserError);
}

TEST(TargetSettings, ResolveLayerIdsAndDtype) {
  auto c = parse_hf_config(R"({"model_type":"qwen3","hidden_size":64,"num_hidden_layers":36,
    "num_attention_heads":4,"intermediate_size":96,"vocab_size":100})", "c");
  using dflash::model::resolve_layer_ids;
  EXPECT_EQ(resolve_layer_ids(c, {}, 5), (std::vector<int64_t>{1, 9, 17, 25, 33}));
  EXPECT_EQ(resolve_layer_ids(c, {2, 3}, 5), (std::vector<int64_t>{2, 3}));
  EXPECT_THROW(resolve_layer_ids(c, {3, 2}, 5), UserError);
  EXPECT_THROW(resolve_layer_ids(c, {36}, 5), UserError);
  EXPECT_EQ(dflash::model::resolve_dtype("auto", at::kCPU), at::kFloat);
  EXPECT_EQ(dflash::model::resolve_dtype("bfloat16", at::kCPU), at::kBFloat16);
  EXPECT_THROW(dflash::model::resolve_dtype("int8", at::kCPU), UserError);
}

// The qwen3_moe / qwen3_5 keys (their math is checked against transformers in
// test_target_moe.py and test_target_qwen35.py; here: defaults, the wrapper layout, the rules).
TEST(HfConfigFamilies, Qwen3MoeSparseRule) {
  using dflash::model::TargetFamily;
  auto c = parse_hf_config(R"({"model_type":"qwen3_moe","hidden_size":64,"num_hidden_layers":6,
    "num_attention_heads":4,"vocab_size":100,"num_local_experts":8,"num_experts_per_tok":2,
    "moe_intermediate_size":32,"decoder_sparse_step":2,"mlp_only_layers":[3]})", "c");
  EXPECT_EQ(c.family, TargetFamily::Qwen3Moe);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.intermediate_size, 6144);  // transformers' default, used by dense layers only
  EXPECT_EQ(c.head_dim, 16);             // hidden / heads, as Qwen3MoeConfig
  std::vector<bool> moe;
  for (int64_t l = 0; l < 6; ++l) moe.push_back(c.is_moe_layer(l));
  EXPECT_EQ(moe, (std::vector<bool>{false, true, false, false, false, true}));
  EXPECT_THROW(parse_hf_config(R"({"model_type":"qwen3_moe","hidden_size":64,"num_hidden_layers":6,
    "num_attention_heads":4,"vocab_size":100,"num_experts":2,"num_experts_per_tok":3,
    "moe_intermediate_size":32})", "c"), UserError);
}

TEST(HfConfigFamilies, Qwen35WrapperAndDefaults) {
  auto c = parse_hf_config(R"({"model_type":"qwen3_5","architectures":["Qwen3_5ForConditionalGeneration"],
    "image_token_id":248056,"tie_word_embeddings":false,"vision_config":{"depth":1},
    "text_config":{"hidden_size":64,"num_hidden_layers":8,"num_attention_heads":4,"num_key_value_heads":2,
      "intermediate_size":96,"vocab_size":248320,"eos_token_id":248044,
      "rope_parameters":{"rope_type":"default","rope_theta":1e7,"partial_rotary_factor":0.25,
        "mrope_section":[11,11,10],"mrope_interleaved":true}}})", "c");
  EXPECT_EQ(c.weight_prefix, "model.language_model.");
  EXPECT_TRUE(c.has_vision);
  EXPECT_EQ(c.image_token_id.value_or(-1), 248056);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.rotary_dim, 64);
  EXPECT_EQ(dflash::model::rope_inv_freq(c).numel(), 32);
  EXPECT_TRUE(c.zero_centered_norm && c.attn_output_gate);
  std::vector<bool> lin;
  for (int64_t l = 0; l < 8; ++l) lin.push_back(c.is_linear_layer(l));
  EXPECT_EQ(lin, (std::vector<bool>{true, true, true, false, true, true, true, false}));
  EXPECT_EQ(c.linear_conv_dim(), 2 * 16 * 128 + 32 * 128);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{248044}));
  // Not supported: named in the message.
  for (const char* bad : {R"({"model_type":"gpt_oss"})",
                          R"({"model_type":"qwen3_5","text_config":null})",
                          R"({"model_type":"qwen3_5_text","hidden_size":64,"num_hidden_layers":2,
                              "num_attention_heads":4,"intermediate_size":96,"vocab_size":10,
                              "layer_types":["linear_attention","sliding_attention"]})"}) {
    try {
      parse_hf_config(bad, "c");
      ADD_FAILURE() << bad;
    } catch (const UserError& e) {
      std::string m = e.what();
      EXPECT_TRUE(m.find("gpt_oss") != std::string::npos || m.find("text_config") != std::string::npos ||
                  m.find("sliding_attention") != std::string::npos) << m;
    }
  }
}
