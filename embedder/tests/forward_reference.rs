//! The crate's own forward pass gives the vectors candle's BERT gave (the implementation the
//! embedder ran before, a padded batch with its attention mask): every stored vector, the
//! verifier's features and the first stage's map were made with it, so the two must agree far
//! inside what any threshold can tell. Needs the model: `scripts/fetch-model.sh`.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config};
use embedder::bert::{cosine, TextVectors, MAX_TOKENS};
use embedder::forward::Precision;
use tokenizers::{PaddingParams, Tokenizer, TruncationParams};

/// Sentence and token vectors of `texts` as candle's `BertModel` computes them, in one padded
/// batch (mean over the mask, L2-normalised; the token rows but `[CLS]`/`[SEP]`).
fn candle_vectors(texts: &[&str]) -> Vec<TextVectors> {
    let dir = common::model_dir();
    let config: Config =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let mut tokenizer = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    tokenizer
        .with_truncation(Some(TruncationParams {
            max_length: MAX_TOKENS,
            ..Default::default()
        }))
        .unwrap();
    tokenizer.with_padding(Some(PaddingParams::default()));
    let weights = std::fs::read(dir.join("model.safetensors")).unwrap();
    let vb = VarBuilder::from_buffered_safetensors(weights, DType::F32, &Device::Cpu).unwrap();
    let model = BertModel::load(vb, &config).unwrap();
    let enc = tokenizer.encode_batch(texts.to_vec(), true).unwrap();
    let len = enc[0].get_ids().len();
    let ids: Vec<u32> = enc.iter().flat_map(|e| e.get_ids().to_vec()).collect();
    let mask: Vec<u32> = enc
        .iter()
        .flat_map(|e| e.get_attention_mask().to_vec())
        .collect();
    let shape = (texts.len(), len);
    let ids = Tensor::from_vec(ids, shape, &Device::Cpu).unwrap();
    let mask_t = Tensor::from_vec(mask.clone(), shape, &Device::Cpu).unwrap();
    let hidden = model
        .forward(&ids, &ids.zeros_like().unwrap(), Some(&mask_t))
        .unwrap()
        .to_vec3::<f32>()
        .unwrap();
    let unit = |v: Vec<f32>| {
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
        v.into_iter().map(|x| x / n).collect::<Vec<f32>>()
    };
    hidden
        .into_iter()
        .enumerate()
        .map(|(i, rows)| {
            let real = mask[i * len..(i + 1) * len]
                .iter()
                .filter(|&&m| m == 1)
                .count();
            let mut mean = vec![0.0f32; rows[0].len()];
            for r in &rows[..real] {
                for (m, v) in mean.iter_mut().zip(r) {
                    *m += v;
                }
            }
            let mean = unit(mean.into_iter().map(|m| m / real as f32).collect());
            let tokens = rows[1..real.saturating_sub(1).max(1)]
                .iter()
                .map(|r| unit(r.clone()))
                .collect();
            (mean, tokens)
        })
        .collect()
}

/// How far below 1 a sentence's and a token's cosine with f16 matrices may fall.
const F16_SENTENCE: f32 = 1e-5;
const F16_TOKEN: f32 = 1e-5;
/// The same with int8 matrices: measured 2.7e-3 and 1.4e-3, the worst on the texts of two and
/// three tokens (`[CLS]` and `[SEP]`, whose few very large activations meet every weight's rounding,
/// are most of their mean); the other five texts are within 6e-4.
const INT8_SENTENCE: f32 = 5e-3;
const INT8_TOKEN: f32 = 3e-3;

#[test]
fn sentence_and_token_vectors_match_candles_bert_over_a_padded_batch() {
    let long = "price of the cheapest flight to lisbon in may ".repeat(40);
    let texts = [
        "What is the capital of France?",
        "",
        "How can I learn to cook Italian food at home without any experience?",
        "IIT JEE 2016 cutoff",
        "Ünïcödé — naïve café, 東京 and emoji 🚀 in one line",
        long.as_str(),
        "ok",
    ];
    let want = candle_vectors(&texts);
    // The pass itself, with the checkpoint's f32 weights: the same floats to rounding.
    let model = common::load_with(Precision::F32);
    let batched = model.embed_with_tokens(&texts).unwrap();
    let mut worst = (1.0f32, 0.0f32);
    for (i, text) in texts.iter().enumerate() {
        let single = model.embed_with_tokens(&[text]).unwrap().remove(0);
        for (label, got) in [("batched", &batched[i]), ("single", &single)] {
            let (sentence, tokens) = got;
            let (want_sentence, want_tokens) = &want[i];
            let c = cosine(sentence, want_sentence);
            let diff = sentence
                .iter()
                .zip(want_sentence)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            worst = (worst.0.min(c), worst.1.max(diff));
            assert!(
                c >= 1.0 - 1e-6 && diff <= 1e-4,
                "{label} {i}: cosine {c}, max diff {diff}"
            );
            assert_eq!(tokens.len(), want_tokens.len(), "{label} {i}: token count");
            for (a, b) in tokens.iter().zip(want_tokens) {
                let c = cosine(a, b);
                assert!(c >= 1.0 - 1e-5, "{label} {i}: a token's cosine {c}");
            }
        }
    }
    eprintln!(
        "f32: worst sentence cosine {}, largest difference {}",
        worst.0, worst.1
    );
    // With f16 matrices (the default), every vector stays far inside what a threshold tells;
    // with int8 ones (the semantic layer's where the CPU has AVX-512 VNNI), within what
    // docs/cache.md measures against the verifier's decisions.
    for (precision, sentence, token) in [
        (Precision::F16, F16_SENTENCE, F16_TOKEN),
        (Precision::Int8, INT8_SENTENCE, INT8_TOKEN),
    ] {
        let model = common::load_with(precision);
        let mut worst = (1.0f32, 1.0f32);
        for (got, (want_sentence, want_tokens)) in
            model.embed_with_tokens(&texts).unwrap().iter().zip(&want)
        {
            worst.0 = worst.0.min(cosine(&got.0, want_sentence));
            for (a, b) in got.1.iter().zip(want_tokens) {
                worst.1 = worst.1.min(cosine(a, b));
            }
        }
        eprintln!(
            "{precision:?}: worst sentence cosine {}, worst token cosine {}",
            worst.0, worst.1
        );
        assert!(
            worst.0 >= 1.0 - sentence && worst.1 >= 1.0 - token,
            "{precision:?}: {worst:?}"
        );
    }
    // Rows of ids with a mask (how the static table is distilled) are the same vectors.
    let tok = model.tokenizer();
    let ids: Vec<u32> = tok
        .encode("What is the capital of France?", true)
        .unwrap()
        .get_ids()
        .to_vec();
    let n = ids.len();
    // Row 0 the whole question, row 1 its first three ids then padding.
    let mut rows = ids.clone();
    rows.extend_from_slice(&ids[..3]);
    rows.resize(2 * n, 0);
    let mut mask = vec![1u32; n + 3];
    mask.resize(2 * n, 0);
    let by_ids = model.embed_ids(rows, mask, (2, n)).unwrap();
    assert!(cosine(&by_ids[0], &want[0].0) >= 1.0 - 1e-6);
    for (ids, mask) in [
        (vec![0; 3], vec![1; 2]),
        (vec![101, 0, 102], vec![1, 0, 1]),
        (vec![0; 3], vec![0; 3]),
    ] {
        let refused = model.embed_ids(ids, mask, (1, 3));
        assert!(refused.is_err_and(|e| e.to_string().contains("mask")));
    }
}
