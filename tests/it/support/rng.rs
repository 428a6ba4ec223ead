//! The one deterministic generator of the tests, the chaos run and the
//! benches, and Zipf over it: a failing run is repeated from its seed.

/// A 64-bit linear congruential generator (Knuth's MMIX constants).
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        (self.next() >> 33) % n.max(1)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Zipf(s) over `0..n` by inverse CDF, drawing from its own `Rng`.
#[derive(Debug, Clone)]
pub struct Zipf {
    cdf: Vec<f64>,
    rng: Rng,
}

impl Zipf {
    pub fn new(n: usize, s: f64, seed: u64) -> Zipf {
        let mut cdf = Vec::with_capacity(n);
        let mut sum = 0.0;
        for k in 1..=n {
            sum += 1.0 / (k as f64).powf(s);
            cdf.push(sum);
        }
        for c in &mut cdf {
            *c /= sum;
        }
        Zipf {
            cdf,
            rng: Rng(seed),
        }
    }

    /// The generator behind the draws, for the uniform choices beside them.
    pub fn rng(&mut self) -> &mut Rng {
        &mut self.rng
    }

    pub fn uniform(&mut self) -> f64 {
        self.rng.uniform()
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.rng.below(n)
    }

    pub fn sample(&mut self) -> usize {
        let u = self.rng.uniform();
        self.cdf
            .partition_point(|c| *c < u)
            .min(self.cdf.len().saturating_sub(1))
    }
}
