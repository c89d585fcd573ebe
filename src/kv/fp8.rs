//! fp8 e4m3 storage: the host reference of the kernels' quantize-on-store.
//!
//! e4m3 (`float8_e4m3fn`): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no
//! infinities; `S.1111.111` is NaN; the largest finite magnitude is 448
//! (`0x7e`), the smallest subnormal 2^-9.
//!
//! A stored value is `quantize_e4m3(x, inv_scale)`: `y = x * inv_scale` in f32 (one
//! IEEE multiply), then `y` rounded to the nearest e4m3 value, ties to even, with
//! finite values beyond ±448 (and ±infinity) saturated to ±448 and NaN kept NaN — the
//! semantics of PTX's `cvt.rn.satfinite.e4m3x2.f32`. Callers pass
//! `inv_scale = 1.0 / scale`, so `dequantize_e4m3(q) * scale` approximates `x`.
//!
//! The GPU kernels compute exactly this, with the same integer steps (so the result
//! does not depend on the GPU having fp8 conversion instructions: sm_80 has none).

/// The e4m3 code of +448, the largest finite value.
pub const E4M3_MAX: u8 = 0x7e;
/// The e4m3 code every NaN input is stored as (positive, whatever the input's sign).
pub const E4M3_NAN: u8 = 0x7f;

/// Quantize `x * inv_scale` to e4m3 (round to nearest even, saturating, NaN -> `0x7f`).
///
/// # Examples
///
/// ```
/// use kvpool::kv::fp8::{dequantize_e4m3, quantize_e4m3};
/// assert_eq!(quantize_e4m3(1.0, 1.0), 0x38);
/// assert_eq!(quantize_e4m3(-448.0, 1.0), 0xfe);
/// assert_eq!(quantize_e4m3(1e9, 1.0), 0x7e);                  // saturates
/// assert_eq!(dequantize_e4m3(quantize_e4m3(3.3, 0.5)), 1.625); // 1.65 -> 1.625
/// assert!(dequantize_e4m3(quantize_e4m3(f32::NAN, 1.0)).is_nan());
/// assert_eq!(quantize_e4m3(-f32::NAN, 1.0), 0x7f);               // NaN loses its sign
/// ```
#[inline]
pub fn quantize_e4m3(x: f32, inv_scale: f32) -> u8 {
    let bits = (x * inv_scale).to_bits();
    let sign = ((bits & 0x8000_0000) >> 24) as u8;
    let a = bits & 0x7fff_ffff;
    if a > 0x7f80_0000 {
        return E4M3_NAN;
    }
    let code = if a < 0x3c80_0000 {
        // Below 2^-6: a subnormal (or zero) of step 2^-9. |y| * 512 is exact in f32.
        let scaled = f32::from_bits(a) * 512.0;
        scaled.round_ties_even() as u32
    } else {
        // Round the 23-bit mantissa to 3 bits, ties to even; a carry bumps the exponent.
        let lsb = (a >> 20) & 1;
        let r = (a + 0x7ffff + lsb) >> 20;
        (r - (120 << 3)).min(E4M3_MAX as u32)
    };
    code as u8 | sign
}

/// The value of an e4m3 code (NaN for `0x7f` / `0xff`).
///
/// # Examples
///
/// ```
/// use kvpool::kv::fp8::dequantize_e4m3;
/// assert_eq!(dequantize_e4m3(0x7e), 448.0);
/// assert_eq!(dequantize_e4m3(0x01), 2f32.powi(-9));
/// assert_eq!(dequantize_e4m3(0x80), -0.0);
/// ```
#[inline]
pub fn dequantize_e4m3(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((code >> 3) & 0xf) as i32;
    let man = (code & 7) as f32;
    if exp == 0xf && code & 7 == 7 {
        return f32::NAN;
    }
    let mag = if exp == 0 { man * 2f32.powi(-9) } else { (1.0 + man / 8.0) * 2f32.powi(exp - 7) };
    sign * mag
}

/// The exact f32 value of an IEEE half given by its bits.
///
/// # Examples
///
/// ```
/// assert_eq!(kvpool::kv::fp8::f16_to_f32(0x3c00), 1.0);
/// assert_eq!(kvpool::kv::fp8::f16_to_f32(0x0001), 2f32.powi(-24));
/// ```
#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match exp {
        0 if man == 0 => sign,
        0 => {
            // Subnormal: man * 2^-24, exact in f32.
            let v = man as f32 * 2f32.powi(-24);
            sign | v.to_bits()
        }
        0x1f => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// The exact f32 value of a bfloat16 given by its bits.
///
/// # Examples
///
/// ```
/// assert_eq!(kvpool::kv::fp8::bf16_to_f32(0x3f80), 1.0);
/// ```
#[inline]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}
