//! The CUDA path agrees with the CPU path (feature `cuda`): the transformer with
//! `BertEmbedder`, the static table with `StaticEmbedder` (or, without a distilled table, with
//! the same arithmetic on a random one), and `GpuIndex` with `CpuIndex` over random operation
//! sequences (namespaces, thresholds, replacement, removal, eviction, expiry).
//!
//! Without a usable GPU (no driver, no CUDA libraries, no device) each test prints why and
//! passes: `cargo test -p embedder --features cuda --test gpu_parity -- --nocapture`.
//! Needs the model: `scripts/fetch-model.sh`.

#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod common;

use embedder::bert::{cosine, Embed, DIM};
use embedder::cuda::{self, GpuEmbedder, GpuIndex, GpuStatic};
use embedder::index::{CpuIndex, Hit, VectorIndex};
use embedder::static_embed::StaticEmbedder;
use half::f16;

fn gpu_present() -> bool {
    match cuda::available() {
        Ok(_) => true,
        Err(e) => {
            eprintln!("skipped: {e}");
            false
        }
    }
}

/// The parity texts (`tests/fixtures/parity-texts.json`, shared with the GPU bundle's
/// comparison against sentence-transformers): short, empty, code, SQL, several scripts, emoji,
/// numbers, and two texts past the 256-token limit that differ only after it.
fn texts() -> Vec<String> {
    serde_json::from_str(include_str!("fixtures/parity-texts.json")).unwrap()
}

#[test]
fn transformer_matches_the_cpu_embedder() {
    if !gpu_present() {
        return;
    }
    let dir = common::model_dir();
    // The CPU's f32 pass: the GPU keeps the checkpoint's f32 weights.
    let cpu = common::load_with(embedder::forward::Precision::F32);
    let gpu = GpuEmbedder::load(&dir, 0).unwrap();
    assert_eq!(gpu.device(), "cuda");
    assert_eq!(gpu.dim(), DIM);
    assert!(gpu.embed_with_tokens(&[]).unwrap().is_empty());

    let owned = texts();
    let texts: Vec<&str> = owned.iter().map(String::as_str).collect();
    assert_eq!(cpu.token_count(texts[texts.len() - 1]).unwrap(), 256);
    let expect = Embed::embed_with_tokens(&cpu, &texts).unwrap();
    let got = gpu.embed_with_tokens(&texts).unwrap();
    assert_eq!(got.len(), texts.len());
    let (mut worst_sentence, mut worst_token) = (1.0f32, 1.0f32);
    for ((text, (cs, ct)), (gs, gt)) in texts.iter().zip(&expect).zip(&got) {
        assert_eq!(gs.len(), DIM);
        let c = cosine(cs, gs);
        worst_sentence = worst_sentence.min(c);
        assert!(c >= 0.9999, "{text:?}: sentence cosine {c}");
        assert_eq!(ct.len(), gt.len(), "{text:?}: token count");
        for (i, (a, b)) in ct.iter().zip(gt).enumerate() {
            let c = cosine(a, b);
            worst_token = worst_token.min(c);
            assert!(c >= 0.999, "{text:?}: token {i} cosine {c}");
            let norm: f32 = b.iter().map(|x| x * x).sum::<f32>().sqrt();
            assert!((norm - 1.0).abs() < 1e-4, "{text:?}: token {i} norm {norm}");
        }
    }
    eprintln!(
        "GPU vs CPU over {} texts: worst sentence cosine {worst_sentence}, worst token cosine \
         {worst_token}",
        texts.len()
    );

    // Padding does not leak: one text at a time gives what the padded batch gave.
    for (text, (gs, _)) in texts.iter().zip(&got).take(6) {
        let single = gpu.embed(&[text]).unwrap().remove(0);
        let c = cosine(&single, gs);
        assert!(c >= 0.99999, "{text:?}: alone vs in a batch, cosine {c}");
    }
    // A large batch (several attention chunks of 256-token texts) agrees with the small one.
    let many: Vec<&str> = (0..300).map(|i| texts[i % texts.len()]).collect();
    let sentences = gpu.embed(&many).unwrap();
    for (i, s) in sentences.iter().enumerate() {
        let c = cosine(s, &got[i % texts.len()].0);
        assert!(c >= 0.99999, "batch of 300, text {i}: cosine {c}");
    }
}

/// `StaticEmbedder::embed_ids`'s arithmetic, for a table given as rows.
fn static_reference(table: &[f32], dim: usize, ids: &[u32]) -> Vec<f32> {
    let mut out = vec![0.0f32; dim];
    for &id in ids {
        let at = id as usize * dim;
        if let Some(row) = table.get(at..at + dim) {
            for (o, x) in out.iter_mut().zip(row) {
                *o += x;
            }
        }
    }
    let norm = out.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        out.iter_mut().for_each(|x| *x /= norm);
    }
    out
}

fn id_batches(vocab: u32) -> Vec<Vec<u32>> {
    let mut rng = Rng(7);
    let mut batch: Vec<Vec<u32>> = (0..200)
        .map(|i| {
            (0..(i % 40) + 1)
                .map(|_| rng.below(u64::from(vocab)) as u32)
                .collect()
        })
        .collect();
    batch.push(Vec::new());
    batch.push(vec![vocab + 5, vocab + 9]);
    batch.push(vec![3, vocab + 1, 3]);
    batch.push((0..5000).map(|i| i % vocab).collect());
    batch
}

fn assert_static_close(got: &[Vec<f32>], expect: &[Vec<f32>]) {
    assert_eq!(got.len(), expect.len());
    for (i, (g, e)) in got.iter().zip(expect).enumerate() {
        assert_eq!(g.len(), e.len());
        for (a, b) in g.iter().zip(e) {
            assert!((a - b).abs() < 1e-5, "text {i}: {a} vs {b}");
        }
    }
}

#[test]
fn static_table_matches_the_cpu_table() {
    if !gpu_present() {
        return;
    }
    // The kernel against the reference arithmetic, on a random table.
    let (vocab, dim) = (1000u32, 24usize);
    let mut rng = Rng(3);
    let table: Vec<f32> = (0..vocab as usize * dim).map(|_| rng.f32() - 0.5).collect();
    let gpu = GpuStatic::new(&table, dim, 0).unwrap();
    assert_eq!((gpu.vocab(), gpu.dim()), (vocab as usize, dim));
    let batch = id_batches(vocab);
    let expect: Vec<Vec<f32>> = batch
        .iter()
        .map(|ids| static_reference(&table, dim, ids))
        .collect();
    assert_static_close(&gpu.embed_ids(&batch).unwrap(), &expect);
    assert!(gpu.embed_ids(&[]).unwrap().is_empty());
    assert_eq!(gpu.embed_ids(&[Vec::new()]).unwrap(), vec![vec![0.0; dim]]);

    // The distilled table against StaticEmbedder itself, when it was distilled.
    let dir = common::model_dir();
    let path = dir.join("static.bin");
    if !path.is_file() {
        eprintln!(
            "skipped the distilled-table part: no {} (distilling takes minutes: `gateway embed \
             distill`)",
            path.display()
        );
        return;
    }
    let cpu = StaticEmbedder::load(&path, &dir.join("tokenizer.json")).unwrap();
    let gpu = GpuStatic::load(&path, 0).unwrap();
    assert_eq!(gpu.dim(), cpu.dim());
    let batch = id_batches(u32::try_from(gpu.vocab()).unwrap());
    let expect: Vec<Vec<f32>> = batch.iter().map(|ids| cpu.embed_ids(ids)).collect();
    assert_static_close(&gpu.embed_ids(&batch).unwrap(), &expect);
}

/// xorshift64*: deterministic test data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// A unit vector rounded to fp16 values, so the CPU index sees what the GPU stores.
    fn vector(&mut self, dim: usize) -> Vec<f32> {
        let mut v: Vec<f32> = (0..dim).map(|_| self.f32() - 0.5).collect();
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        v.iter_mut()
            .for_each(|x| *x = f16::from_f32(*x / n).to_f32());
        v
    }
}

/// Same hits, allowing only what summation order can change: two entries whose scores differ
/// by less than `EPS` may swap, and an entry within `EPS` of the threshold may be in one list
/// only.
fn assert_same_hits(cpu: &[Hit], gpu: &[Hit], threshold: f32, what: &str) {
    const EPS: f32 = 1e-5;
    let close = |a: f32, b: f32| (a - b).abs() < EPS;
    let n = cpu.len().min(gpu.len());
    for extra in cpu[n..].iter().chain(&gpu[n..]) {
        assert!(
            close(extra.score, threshold),
            "{what}: cpu {cpu:?} vs gpu {gpu:?}"
        );
    }
    for i in 0..n {
        assert!(
            close(cpu[i].score, gpu[i].score),
            "{what}: rank {i}: cpu {cpu:?} vs gpu {gpu:?}"
        );
        if cpu[i].id != gpu[i].id {
            let twin = gpu
                .iter()
                .find(|h| h.id == cpu[i].id)
                .is_some_and(|h| close(h.score, cpu[i].score));
            assert!(twin, "{what}: rank {i}: cpu {cpu:?} vs gpu {gpu:?}");
        }
    }
}

/// Random inserts (with replacements), searches and removals over four namespaces, past the
/// capacity (evictions, steered by the LRU touches of the searches), without expiry: every
/// search, `len` and `contains` agree.
fn random_operations(dim: usize, capacity: usize, ops: usize, seed: u64) {
    let mut cpu = CpuIndex::new(dim, capacity, 1_000_000_000);
    let mut gpu = GpuIndex::new(dim, capacity, 1_000_000_000, 0).unwrap();
    let mut rng = Rng(seed);
    let mut stored: Vec<Vec<f32>> = Vec::new();
    let thresholds = [-1.0f32, 0.0, 0.05, 0.5, 0.99];
    let mut searches = 0;
    for op in 0..ops {
        let now = op as i64;
        match rng.below(10) {
            0..=5 => {
                let ns = rng.below(3);
                let id = rng.below(capacity as u64 * 2);
                let v = rng.vector(dim);
                cpu.insert(ns, id, &v, now);
                gpu.insert(ns, id, &v, now);
                stored.push(v);
            }
            6..=8 => {
                let ns = rng.below(4);
                let query = if !stored.is_empty() && rng.below(2) == 0 {
                    stored[rng.below(stored.len() as u64) as usize].clone()
                } else {
                    rng.vector(dim)
                };
                let k = [1, 5, 16][rng.below(3) as usize];
                let threshold = thresholds[rng.below(thresholds.len() as u64) as usize];
                let c = cpu.search(ns, &query, k, threshold, now);
                let g = gpu.search(ns, &query, k, threshold, now);
                assert_same_hits(
                    &c,
                    &g,
                    threshold,
                    &format!("op {op}: ns {ns}, k {k}, threshold {threshold}"),
                );
                searches += 1;
            }
            _ => {
                let id = rng.below(capacity as u64 * 2);
                assert_eq!(cpu.remove(id), gpu.remove(id), "op {op}: remove {id}");
            }
        }
        assert_eq!(cpu.len(), gpu.len(), "op {op}: len");
        let probe = rng.below(capacity as u64 * 2);
        assert_eq!(
            cpu.contains(probe),
            gpu.contains(probe),
            "op {op}: contains"
        );
    }
    assert!(gpu.take_error().is_none());
    eprintln!("index dim {dim}: {ops} operations, {searches} searches agree");
}

#[test]
fn index_matches_the_cpu_index_over_random_operations() {
    if !gpu_present() {
        return;
    }
    random_operations(DIM, 300, 3000, 11);
    // A dimension that is not a multiple of 8 (rows padded on the device).
    random_operations(20, 50, 1500, 12);
}

#[test]
fn index_expiry_and_eviction_match_the_cpu_index() {
    if !gpu_present() {
        return;
    }
    // CpuIndex's own unit test, run against both.
    let mut rng = Rng(5);
    let vs: Vec<Vec<f32>> = (0..10).map(|_| rng.vector(8)).collect();
    let mut cpu = CpuIndex::new(8, 3, 1_000);
    let mut gpu = GpuIndex::new(8, 3, 1_000, 0).unwrap();
    let both = |f: &mut dyn FnMut(&mut dyn VectorIndex) -> Vec<Hit>,
                cpu: &mut CpuIndex,
                gpu: &mut GpuIndex| {
        let c = f(cpu);
        let g = f(gpu);
        assert_eq!(
            c.iter().map(|h| h.id).collect::<Vec<_>>(),
            g.iter().map(|h| h.id).collect::<Vec<_>>()
        );
        c
    };
    for (i, v) in vs.iter().enumerate().take(3) {
        cpu.insert(7, i as u64, v, 0);
        gpu.insert(7, i as u64, v, 0);
    }
    let hits = both(
        &mut |x| x.search(7, &vs[0], 1, 0.99, 10),
        &mut cpu,
        &mut gpu,
    );
    assert_eq!(hits[0].id, 0);
    cpu.insert(7, 3, &vs[3], 20);
    gpu.insert(7, 3, &vs[3], 20);
    assert_eq!((cpu.len(), gpu.len()), (3, 3));
    assert!(!gpu.contains(1), "the least recently used entry is evicted");
    assert!(both(
        &mut |x| x.search(7, &vs[1], 1, 0.99, 30),
        &mut cpu,
        &mut gpu
    )
    .is_empty());
    assert_eq!(
        both(
            &mut |x| x.search(7, &vs[2], 1, 0.99, 30),
            &mut cpu,
            &mut gpu
        )[0]
        .id,
        2
    );
    // Past the TTL nothing is returned, and the expired entry the search met is dropped.
    assert!(both(
        &mut |x| x.search(7, &vs[3], 1, 0.99, 1_020),
        &mut cpu,
        &mut gpu
    )
    .is_empty());
    assert!(!cpu.contains(3) && !gpu.contains(3));
    // Replacing an id keeps one entry.
    for x in [&mut cpu as &mut dyn VectorIndex, &mut gpu] {
        x.insert(7, 9, &vs[9], 2_000);
        x.insert(7, 9, &vs[9], 2_000);
    }
    assert_eq!(
        both(
            &mut |x| x.search(7, &vs[9], 5, 0.99, 2_001),
            &mut cpu,
            &mut gpu
        )
        .len(),
        1
    );

    // Expiry at scale: entries inserted at 0 expire at 1000, refreshed ones live on; a search
    // returns only live entries, in both.
    let dim = DIM;
    let mut cpu = CpuIndex::new(dim, 2_000, 1_000);
    let mut gpu = GpuIndex::new(dim, 2_000, 1_000, 0).unwrap();
    let vs: Vec<Vec<f32>> = (0..1_000).map(|_| rng.vector(dim)).collect();
    for (i, v) in vs.iter().enumerate() {
        cpu.insert(1, i as u64, v, 0);
        gpu.insert(1, i as u64, v, 0);
    }
    for (i, v) in vs.iter().enumerate().step_by(3) {
        cpu.insert(1, i as u64, v, 600);
        gpu.insert(1, i as u64, v, 600);
    }
    for (q, v) in vs.iter().enumerate().take(60) {
        for threshold in [-1.0, 0.1, 0.99] {
            let c = cpu.search(1, v, 5, threshold, 1_200);
            let g = gpu.search(1, v, 5, threshold, 1_200);
            assert_same_hits(&c, &g, threshold, &format!("query {q} after expiry"));
            assert!(
                g.iter().all(|h| h.id % 3 == 0),
                "only refreshed entries live"
            );
            if q % 3 == 0 {
                assert_eq!(g.first().map(|h| h.id), Some(q as u64));
            }
        }
    }
    // A search with threshold -1 meets every expired entry; the GPU drops those it reports
    // (up to 256 per search), so after a few searches only the live third is left.
    for _ in 0..4 {
        gpu.search(1, &vs[0], 1, -1.0, 1_200);
    }
    assert_eq!(gpu.len(), vs.len().div_ceil(3));

    // insert_many is insert, row by row.
    let mut one = GpuIndex::new(dim, 100, 1_000, 0).unwrap();
    let mut many = GpuIndex::new(dim, 100, 1_000, 0).unwrap();
    let entries: Vec<(u64, &[f32])> = vs
        .iter()
        .take(150)
        .enumerate()
        .map(|(i, v)| ((i % 120) as u64, v.as_slice()))
        .collect();
    for &(id, v) in &entries {
        one.insert(4, id, v, 5);
    }
    many.insert_many(4, &entries, 5).unwrap();
    assert_eq!(one.len(), many.len());
    for v in vs.iter().take(150) {
        let a = one.search(4, v, 16, -1.0, 6);
        let b = many.search(4, v, 16, -1.0, 6);
        assert_same_hits(&a, &b, -1.0, "insert_many");
    }
}
