//! A small typed PTX builder.
//!
//! Registers are typed values ([`R32`], [`R64`], [`Pred`], [`F32`], [`H16`]), each class
//! with its own prefix (`%r`, `%rd`, `%p`, `%f`, `%rs`), and every instruction helper
//! takes and returns the classes its PTX form needs, so a `b64` address can never be
//! passed where a `b32` is expected: the classic source of `CUDA_ERROR_INVALID_PTX`
//! becomes a Rust type error. The `.reg` declarations are written from the counters
//! the builder kept, so they always match what the body uses.
//!
//! Output is deterministic: the same calls give the same text, byte for byte.

use std::fmt::{self, Write as _};

/// The GPU architecture a module is generated for, with the PTX ISA version written
/// beside it. Both versions are accepted by every driver from CUDA 11.8 on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    /// Ampere (A100): `.target sm_80`, `.version 7.0`.
    Sm80,
    /// Hopper (H100, H200): `.target sm_90`, `.version 7.8`.
    Sm90,
}

impl Target {
    /// Every target, in a fixed order.
    pub const ALL: [Target; 2] = [Target::Sm80, Target::Sm90];

    /// The `.target` name, e.g. `sm_90`.
    pub fn sm(self) -> &'static str {
        match self {
            Target::Sm80 => "sm_80",
            Target::Sm90 => "sm_90",
        }
    }

    /// The `.version` (PTX ISA) written for this target: the first ISA that knows it.
    pub fn ptx_version(self) -> &'static str {
        match self {
            Target::Sm80 => "7.0",
            Target::Sm90 => "7.8",
        }
    }

    /// Whether the target has `cvt.rn.satfinite.e4m3x2.f32` (sm_89 and newer).
    pub fn has_fp8_cvt(self) -> bool {
        self.compute_capability() >= 89
    }

    /// The compute capability as `major * 10 + minor`.
    pub fn compute_capability(self) -> u32 {
        match self {
            Target::Sm80 => 80,
            Target::Sm90 => 90,
        }
    }
}

/// A 32-bit integer register, `%rN` (`.b32`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct R32(u32);
/// A 64-bit integer register, `%rdN` (`.b64`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct R64(u32);
/// A predicate register, `%pN` (`.pred`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pred(u32);
/// A 32-bit float register, `%fN` (`.f32`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct F32(u32);
/// A 16-bit register, `%rsN` (`.b16`), for half-precision values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct H16(u32);

impl fmt::Display for R32 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%r{}", self.0)
    }
}
impl fmt::Display for R64 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%rd{}", self.0)
    }
}
impl fmt::Display for Pred {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%p{}", self.0)
    }
}
impl fmt::Display for F32 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%f{}", self.0)
    }
}
impl fmt::Display for H16 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%rs{}", self.0)
    }
}

/// A 32-bit source operand: a register or an immediate.
pub trait Src32: Copy {
    /// The operand as PTX text.
    fn text(self) -> String;
}
impl Src32 for R32 {
    fn text(self) -> String {
        self.to_string()
    }
}
impl Src32 for u32 {
    fn text(self) -> String {
        self.to_string()
    }
}

/// A 64-bit source operand: a register or an immediate.
pub trait Src64: Copy {
    /// The operand as PTX text.
    fn text(self) -> String;
}
impl Src64 for R64 {
    fn text(self) -> String {
        self.to_string()
    }
}
impl Src64 for u64 {
    fn text(self) -> String {
        self.to_string()
    }
}

/// The type of a kernel parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamTy {
    /// `.u64`: a device pointer or a 64-bit count.
    U64,
    /// `.u32`.
    U32,
    /// `.f32`.
    F32,
}

impl ParamTy {
    fn name(self) -> &'static str {
        match self {
            ParamTy::U64 => "u64",
            ParamTy::U32 => "u32",
            ParamTy::F32 => "f32",
        }
    }
}

/// A declared kernel parameter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Param {
    /// Its name in the `.param` list.
    pub name: String,
    /// Its type.
    pub ty: ParamTy,
}

/// A handle to a declared parameter, for loading it.
#[derive(Clone, Copy, Debug)]
pub struct ParamRef<T> {
    index: usize,
    _ty: core::marker::PhantomData<T>,
}

/// A branch target inside one kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Label(u32);

/// Comparison operators for `setp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cmp {
    /// `==`
    Eq,
    /// `!=`
    Ne,
    /// `<`
    Lt,
    /// `<=`
    Le,
    /// `>`
    Gt,
    /// `>=`
    Ge,
}

impl Cmp {
    fn name(self) -> &'static str {
        match self {
            Cmp::Eq => "eq",
            Cmp::Ne => "ne",
            Cmp::Lt => "lt",
            Cmp::Le => "le",
            Cmp::Gt => "gt",
            Cmp::Ge => "ge",
        }
    }
}

/// Width of a global memory access, in bytes per thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Width {
    /// 1 byte: `.u8`.
    B1,
    /// 2 bytes: `.u16`.
    B2,
    /// 4 bytes: `.u32`.
    B4,
    /// 8 bytes: `.v2.u32`.
    B8,
    /// 16 bytes: `.v4.u32`.
    B16,
}

impl Width {
    /// The width for `bytes` (1, 2, 4, 8 or 16).
    pub fn from_bytes(bytes: u32) -> Option<Width> {
        Some(match bytes {
            1 => Width::B1,
            2 => Width::B2,
            4 => Width::B4,
            8 => Width::B8,
            16 => Width::B16,
            _ => return None,
        })
    }

    /// Bytes per access.
    pub fn bytes(self) -> u32 {
        match self {
            Width::B1 => 1,
            Width::B2 => 2,
            Width::B4 => 4,
            Width::B8 => 8,
            Width::B16 => 16,
        }
    }

    /// 32-bit registers the access moves (sub-word accesses use one, zero-extended).
    pub fn words(self) -> usize {
        match self {
            Width::B16 => 4,
            Width::B8 => 2,
            _ => 1,
        }
    }

    fn suffix(self) -> &'static str {
        match self {
            Width::B1 => "u8",
            Width::B2 => "u16",
            Width::B4 => "u32",
            Width::B8 => "v2.u32",
            Width::B16 => "v4.u32",
        }
    }
}

/// Which special register to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Special {
    /// `%tid.x`
    TidX,
    /// `%ntid.x`
    NtidX,
    /// `%ctaid.x`
    CtaidX,
    /// `%ctaid.y`
    CtaidY,
    /// `%ctaid.z`
    CtaidZ,
    /// `%nctaid.x`
    NctaidX,
}

impl Special {
    fn name(self) -> &'static str {
        match self {
            Special::TidX => "%tid.x",
            Special::NtidX => "%ntid.x",
            Special::CtaidX => "%ctaid.x",
            Special::CtaidY => "%ctaid.y",
            Special::CtaidZ => "%ctaid.z",
            Special::NctaidX => "%nctaid.x",
        }
    }
}

/// One `.entry` being built.
#[derive(Debug)]
pub struct Kernel {
    name: String,
    params: Vec<Param>,
    body: String,
    n_r32: u32,
    n_r64: u32,
    n_pred: u32,
    n_f32: u32,
    n_h16: u32,
    n_label: u32,
    /// `.shared` arrays: (name, words, alignment in bytes).
    shared: Vec<(String, u32, u32)>,
}

/// A `.shared` array of 32-bit words declared in one kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shared(String);

impl Kernel {
    /// A kernel named `name` with no parameters and an empty body.
    pub fn new(name: impl Into<String>) -> Kernel {
        Kernel {
            name: name.into(),
            params: Vec::new(),
            body: String::new(),
            n_r32: 0,
            n_r64: 0,
            n_pred: 0,
            n_f32: 0,
            n_h16: 0,
            n_label: 0,
            shared: Vec::new(),
        }
    }

    /// The kernel's entry name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The declared parameters, in order.
    pub fn params(&self) -> &[Param] {
        &self.params
    }

    fn param(&mut self, name: &str, ty: ParamTy) -> usize {
        assert!(self.params.iter().all(|p| p.name != name), "duplicate parameter {name}");
        self.params.push(Param { name: name.to_string(), ty });
        self.params.len() - 1
    }

    /// Declare a `.u64` parameter (a device pointer or a 64-bit value).
    pub fn param_u64(&mut self, name: &str) -> ParamRef<R64> {
        ParamRef { index: self.param(name, ParamTy::U64), _ty: core::marker::PhantomData }
    }

    /// Declare a `.u32` parameter.
    pub fn param_u32(&mut self, name: &str) -> ParamRef<R32> {
        ParamRef { index: self.param(name, ParamTy::U32), _ty: core::marker::PhantomData }
    }

    /// Declare a `.f32` parameter.
    pub fn param_f32(&mut self, name: &str) -> ParamRef<F32> {
        ParamRef { index: self.param(name, ParamTy::F32), _ty: core::marker::PhantomData }
    }

    fn param_sym(&self, index: usize) -> String {
        format!("{}_param_{}", self.name, self.params[index].name)
    }

    // ---- registers -------------------------------------------------------------

    /// A fresh `%r` register.
    pub fn r32(&mut self) -> R32 {
        self.n_r32 += 1;
        R32(self.n_r32 - 1)
    }
    /// A fresh `%rd` register.
    pub fn r64(&mut self) -> R64 {
        self.n_r64 += 1;
        R64(self.n_r64 - 1)
    }
    /// A fresh `%p` register.
    pub fn pred(&mut self) -> Pred {
        self.n_pred += 1;
        Pred(self.n_pred - 1)
    }
    /// A fresh `%f` register.
    pub fn f32(&mut self) -> F32 {
        self.n_f32 += 1;
        F32(self.n_f32 - 1)
    }
    /// A fresh `%rs` register.
    pub fn h16(&mut self) -> H16 {
        self.n_h16 += 1;
        H16(self.n_h16 - 1)
    }

    // ---- raw emission ----------------------------------------------------------

    fn ins(&mut self, args: fmt::Arguments<'_>) {
        let _ = writeln!(self.body, "\t{args};");
    }

    fn ins_if(&mut self, guard: Option<(Pred, bool)>, args: fmt::Arguments<'_>) {
        match guard {
            None => self.ins(args),
            Some((p, true)) => {
                let _ = writeln!(self.body, "\t@{p} {args};");
            }
            Some((p, false)) => {
                let _ = writeln!(self.body, "\t@!{p} {args};");
            }
        }
    }

    /// A comment line in the body.
    pub fn comment(&mut self, text: &str) {
        let _ = writeln!(self.body, "\t// {text}");
    }

    // ---- parameters and special registers --------------------------------------

    /// `ld.param.u64`
    pub fn ld_param_u64(&mut self, p: ParamRef<R64>) -> R64 {
        let d = self.r64();
        let sym = self.param_sym(p.index);
        self.ins(format_args!("ld.param.u64 {d}, [{sym}]"));
        d
    }
    /// `ld.param.u32`
    pub fn ld_param_u32(&mut self, p: ParamRef<R32>) -> R32 {
        let d = self.r32();
        let sym = self.param_sym(p.index);
        self.ins(format_args!("ld.param.u32 {d}, [{sym}]"));
        d
    }
    /// `ld.param.f32`
    pub fn ld_param_f32(&mut self, p: ParamRef<F32>) -> F32 {
        let d = self.f32();
        let sym = self.param_sym(p.index);
        self.ins(format_args!("ld.param.f32 {d}, [{sym}]"));
        d
    }

    /// `mov.u32 d, %special`
    pub fn special(&mut self, s: Special) -> R32 {
        let d = self.r32();
        self.ins(format_args!("mov.u32 {d}, {}", s.name()));
        d
    }

    // ---- 32-bit integer ----------------------------------------------------------

    /// `mov.u32 d, a`
    pub fn mov_u32(&mut self, a: impl Src32) -> R32 {
        let d = self.r32();
        self.ins(format_args!("mov.u32 {d}, {}", a.text()));
        d
    }
    /// `mov.u32 d, a` into an existing register (loop variables).
    pub fn set_u32(&mut self, d: R32, a: impl Src32) {
        self.ins(format_args!("mov.u32 {d}, {}", a.text()));
    }

    fn bin32(&mut self, op: &str, a: R32, b: impl Src32) -> R32 {
        let d = self.r32();
        self.ins(format_args!("{op} {d}, {a}, {}", b.text()));
        d
    }
    /// `add.u32`
    pub fn add_u32(&mut self, a: R32, b: impl Src32) -> R32 {
        self.bin32("add.u32", a, b)
    }
    /// `add.u32 d, d, b` in place (loop counters).
    pub fn add_u32_to(&mut self, d: R32, b: impl Src32) {
        self.ins(format_args!("add.u32 {d}, {d}, {}", b.text()));
    }
    /// `sub.u32`
    pub fn sub_u32(&mut self, a: R32, b: impl Src32) -> R32 {
        self.bin32("sub.u32", a, b)
    }
    /// `mul.lo.u32`
    pub fn mul_lo_u32(&mut self, a: R32, b: impl Src32) -> R32 {
        self.bin32("mul.lo.u32", a, b)
    }
    /// `mad.lo.u32 d, a, b, c`
    pub fn mad_lo_u32(&mut self, a: R32, b: impl Src32, c: impl Src32) -> R32 {
        let d = self.r32();
        self.ins(format_args!("mad.lo.u32 {d}, {a}, {}, {}", b.text(), c.text()));
        d
    }
    /// `div.u32`
    pub fn div_u32(&mut self, a: R32, b: impl Src32) -> R32 {
        self.bin32("div.u32", a, b)
    }
    /// `rem.u32`
    pub fn rem_u32(&mut self, a: R32, b: impl Src32) -> R32 {
        self.bin32("rem.u32", a, b)
    }
    /// `min.u32`
    pub fn min_u32(&mut self, a: R32, b: impl Src32) -> R32 {
        self.bin32("min.u32", a, b)
    }
    /// `and.b32`
    pub fn and_b32(&mut self, a: R32, b: impl Src32) -> R32 {
        self.bin32("and.b32", a, b)
    }
    /// `or.b32`
    pub fn or_b32(&mut self, a: R32, b: impl Src32) -> R32 {
        self.bin32("or.b32", a, b)
    }
    /// `shl.b32`
    pub fn shl_b32(&mut self, a: R32, b: impl Src32) -> R32 {
        self.bin32("shl.b32", a, b)
    }
    /// `shr.u32`
    pub fn shr_u32(&mut self, a: R32, b: impl Src32) -> R32 {
        self.bin32("shr.u32", a, b)
    }
    /// `setp.<cmp>.u32`
    pub fn setp_u32(&mut self, cmp: Cmp, a: R32, b: impl Src32) -> Pred {
        let p = self.pred();
        self.ins(format_args!("setp.{}.u32 {p}, {a}, {}", cmp.name(), b.text()));
        p
    }
    /// `selp.b32 d, a, b, p` (`p ? a : b`)
    pub fn selp_b32(&mut self, a: impl Src32, b: impl Src32, p: Pred) -> R32 {
        let d = self.r32();
        self.ins(format_args!("selp.b32 {d}, {}, {}, {p}", a.text(), b.text()));
        d
    }

    // ---- 64-bit integer ------------------------------------------------------------

    /// `cvt.u64.u32`
    pub fn cvt_u64_u32(&mut self, a: R32) -> R64 {
        let d = self.r64();
        self.ins(format_args!("cvt.u64.u32 {d}, {a}"));
        d
    }
    /// `mul.wide.u32 d, a, b`: the full 64-bit product of two 32-bit values.
    pub fn mul_wide_u32(&mut self, a: R32, b: impl Src32) -> R64 {
        let d = self.r64();
        self.ins(format_args!("mul.wide.u32 {d}, {a}, {}", b.text()));
        d
    }
    /// `add.u64`
    pub fn add_u64(&mut self, a: R64, b: impl Src64) -> R64 {
        let d = self.r64();
        self.ins(format_args!("add.u64 {d}, {a}, {}", b.text()));
        d
    }
    /// `add.u64 d, d, b` in place (loop pointers).
    pub fn add_u64_to(&mut self, d: R64, b: impl Src64) {
        self.ins(format_args!("add.u64 {d}, {d}, {}", b.text()));
    }
    /// `sub.u64`
    pub fn sub_u64(&mut self, a: R64, b: impl Src64) -> R64 {
        let d = self.r64();
        self.ins(format_args!("sub.u64 {d}, {a}, {}", b.text()));
        d
    }
    /// `mul.lo.u64`
    pub fn mul_lo_u64(&mut self, a: R64, b: impl Src64) -> R64 {
        let d = self.r64();
        self.ins(format_args!("mul.lo.u64 {d}, {a}, {}", b.text()));
        d
    }
    /// `mad.wide.u32 d, a, b, c`: `a * b + c` with a 64-bit product and sum.
    pub fn mad_wide_u32(&mut self, a: R32, b: impl Src32, c: R64) -> R64 {
        let d = self.r64();
        self.ins(format_args!("mad.wide.u32 {d}, {a}, {}, {c}", b.text()));
        d
    }
    /// `selp.b64 d, a, b, p` (`p ? a : b`)
    pub fn selp_b64(&mut self, a: R64, b: R64, p: Pred) -> R64 {
        let d = self.r64();
        self.ins(format_args!("selp.b64 {d}, {a}, {b}, {p}"));
        d
    }
    /// `setp.<cmp>.u64`
    pub fn setp_u64(&mut self, cmp: Cmp, a: R64, b: impl Src64) -> Pred {
        let p = self.pred();
        self.ins(format_args!("setp.{}.u64 {p}, {a}, {}", cmp.name(), b.text()));
        p
    }

    // ---- predicates -----------------------------------------------------------------

    /// `or.pred`
    pub fn or_pred(&mut self, a: Pred, b: Pred) -> Pred {
        let p = self.pred();
        self.ins(format_args!("or.pred {p}, {a}, {b}"));
        p
    }
    /// `and.pred`
    pub fn and_pred(&mut self, a: Pred, b: Pred) -> Pred {
        let p = self.pred();
        self.ins(format_args!("and.pred {p}, {a}, {b}"));
        p
    }

    // ---- float ----------------------------------------------------------------------

    /// `mov.b32 f, r`: reinterpret integer bits as a float.
    pub fn bits_to_f32(&mut self, a: R32) -> F32 {
        let d = self.f32();
        self.ins(format_args!("mov.b32 {d}, {a}"));
        d
    }
    /// `mov.b32 r, f`: reinterpret float bits as an integer.
    pub fn f32_to_bits(&mut self, a: F32) -> R32 {
        let d = self.r32();
        self.ins(format_args!("mov.b32 {d}, {a}"));
        d
    }
    /// `mul.rn.f32` (IEEE round-to-nearest-even, subnormals kept).
    pub fn mul_rn_f32(&mut self, a: F32, b: F32) -> F32 {
        let d = self.f32();
        self.ins(format_args!("mul.rn.f32 {d}, {a}, {b}"));
        d
    }
    /// `mul.rn.f32 d, a, imm` with an exact float immediate written as hex bits.
    pub fn mul_rn_f32_imm(&mut self, a: F32, imm: f32) -> F32 {
        let d = self.f32();
        self.ins(format_args!("mul.rn.f32 {d}, {a}, 0f{:08X}", imm.to_bits()));
        d
    }
    /// `selp.f32 d, a, b, p` (`p ? a : b`)
    pub fn selp_f32(&mut self, a: F32, b: F32, p: Pred) -> F32 {
        let d = self.f32();
        self.ins(format_args!("selp.f32 {d}, {a}, {b}, {p}"));
        d
    }
    /// `cvt.rni.u32.f32`: round to the nearest integer, ties to even.
    pub fn cvt_rni_u32_f32(&mut self, a: F32) -> R32 {
        let d = self.r32();
        self.ins(format_args!("cvt.rni.u32.f32 {d}, {a}"));
        d
    }
    /// `mov.b32 {lo, hi}, a`: split a word into its two 16-bit halves.
    pub fn unpack_b16x2(&mut self, a: R32) -> (H16, H16) {
        let (lo, hi) = (self.h16(), self.h16());
        self.ins(format_args!("mov.b32 {{{lo}, {hi}}}, {a}"));
        (lo, hi)
    }
    /// `cvt.rn.satfinite.e4m3x2.f32 d, hi, lo` (sm_89+, PTX ISA 7.8): two floats to
    /// two fp8 e4m3 bytes, `hi` in the upper byte; round to nearest even, saturating.
    pub fn cvt_e4m3x2(&mut self, hi: F32, lo: F32) -> H16 {
        let d = self.h16();
        self.ins(format_args!("cvt.rn.satfinite.e4m3x2.f32 {d}, {hi}, {lo}"));
        d
    }
    /// `mov.b32 d, {lo, hi}`: join two 16-bit halves into a word.
    pub fn pack_b16x2(&mut self, lo: H16, hi: H16) -> R32 {
        let d = self.r32();
        self.ins(format_args!("mov.b32 {d}, {{{lo}, {hi}}}"));
        d
    }
    /// `cvt.u32.u16`: zero-extend a 16-bit value.
    pub fn cvt_u32_u16(&mut self, a: H16) -> R32 {
        let d = self.r32();
        self.ins(format_args!("cvt.u32.u16 {d}, {a}"));
        d
    }
    /// `cvt.f32.f16`: an exact widening of a half.
    pub fn cvt_f32_f16(&mut self, a: H16) -> F32 {
        let d = self.f32();
        self.ins(format_args!("cvt.f32.f16 {d}, {a}"));
        d
    }

    // ---- memory -----------------------------------------------------------------------

    /// `ld.global[.nc].u32 d, [addr+off]`
    pub fn ld_global_u32(&mut self, addr: R64, off: u32, nc: bool) -> R32 {
        self.ld_global(Width::B4, addr, off, nc, None)[0]
    }

    /// `ld.global[.nc].u64 d, [addr+off]`: one 64-bit value (a device address in a
    /// table), `off` and `addr` 8-byte aligned.
    pub fn ld_global_u64(&mut self, addr: R64, off: u32, nc: bool) -> R64 {
        let d = self.r64();
        let space = if nc { "global.nc" } else { "global" };
        let at = mem_operand(addr, off);
        self.ins(format_args!("ld.{space}.u64 {d}, {at}"));
        d
    }

    /// A global load of `width` bytes into fresh 32-bit registers (sub-word widths are
    /// zero-extended into one register). `nc` uses the read-only data path, for buffers
    /// that nothing writes while the kernel runs. `guard` predicates the load.
    pub fn ld_global(&mut self, width: Width, addr: R64, off: u32, nc: bool, guard: Option<(Pred, bool)>) -> Vec<R32> {
        let regs: Vec<R32> = (0..width.words()).map(|_| self.r32()).collect();
        let space = if nc { "global.nc" } else { "global" };
        let at = mem_operand(addr, off);
        let dst = reg_list(&regs);
        self.ins_if(guard, format_args!("ld.{space}.{} {dst}, {at}", width.suffix()));
        regs
    }

    /// A global store of `width` bytes from `regs` (`width.words()` of them; sub-word
    /// widths store the low bits of one register).
    pub fn st_global(&mut self, width: Width, addr: R64, off: u32, regs: &[R32], guard: Option<(Pred, bool)>) {
        assert_eq!(regs.len(), width.words(), "store of {width:?} needs {} registers", width.words());
        let at = mem_operand(addr, off);
        let src = reg_list(regs);
        self.ins_if(guard, format_args!("st.global.{} {at}, {src}", width.suffix()));
    }

    /// `st.relaxed.sys.global.u32 [addr+off], a`: a store the host sees while the
    /// kernel still runs (mapped host memory; system scope, sm_70+).
    pub fn st_global_sys_u32(&mut self, addr: R64, off: u32, a: impl Src32, guard: Option<(Pred, bool)>) {
        let at = mem_operand(addr, off);
        self.ins_if(guard, format_args!("st.relaxed.sys.global.u32 {at}, {}", a.text()));
    }

    /// `st.global.u32 [addr+off], a`
    pub fn st_global_u32(&mut self, addr: R64, off: u32, a: impl Src32, guard: Option<(Pred, bool)>) {
        let at = mem_operand(addr, off);
        self.ins_if(guard, format_args!("st.global.u32 {at}, {}", a.text()));
    }

    /// Declare a `.shared` array of `words` 32-bit words, aligned to `align` bytes
    /// (named after the kernel, so names never clash within a module).
    pub fn shared_words(&mut self, name: &str, words: u32, align: u32) -> Shared {
        let sym = format!("{}_{name}", self.name);
        assert!(self.shared.iter().all(|(n, _, _)| *n != sym), "duplicate shared array {name}");
        self.shared.push((sym.clone(), words, align));
        Shared(sym)
    }

    /// A shared-memory store of `width` bytes from `regs` at byte `off` of `at`.
    pub fn st_shared(&mut self, width: Width, at: &Shared, off: u32, regs: &[R32], guard: Option<(Pred, bool)>) {
        assert_eq!(regs.len(), width.words(), "store of {width:?} needs {} registers", width.words());
        let src = reg_list(regs);
        let addr = if off == 0 { format!("[{}]", at.0) } else { format!("[{}+{off}]", at.0) };
        self.ins_if(guard, format_args!("st.shared.{} {addr}, {src}", width.suffix()));
    }

    /// A shared-memory load of `width` bytes at byte `off` of `at` into fresh registers.
    pub fn ld_shared(&mut self, width: Width, at: &Shared, off: u32) -> Vec<R32> {
        let regs: Vec<R32> = (0..width.words()).map(|_| self.r32()).collect();
        let dst = reg_list(&regs);
        let addr = if off == 0 { format!("[{}]", at.0) } else { format!("[{}+{off}]", at.0) };
        self.ins(format_args!("ld.shared.{} {dst}, {addr}", width.suffix()));
        regs
    }

    // ---- control flow -------------------------------------------------------------------

    /// A new label (placed later with [`place`](Self::place)).
    pub fn label(&mut self) -> Label {
        self.n_label += 1;
        Label(self.n_label - 1)
    }

    fn label_name(&self, l: Label) -> String {
        format!("$L__{}_{}", self.name, l.0)
    }

    /// Put `l` here.
    pub fn place(&mut self, l: Label) {
        let name = self.label_name(l);
        let _ = writeln!(self.body, "{name}:");
    }

    /// `bra.uni l`
    pub fn bra(&mut self, l: Label) {
        let name = self.label_name(l);
        self.ins(format_args!("bra.uni {name}"));
    }

    /// `@p bra l` (or `@!p` when `when` is false).
    pub fn bra_if(&mut self, p: Pred, when: bool, l: Label) {
        let name = self.label_name(l);
        self.ins_if(Some((p, when)), format_args!("bra {name}"));
    }

    /// `bar.sync 0`: every thread of the block waits here; global and shared memory
    /// accesses before it are visible to the block's threads after it. Every thread
    /// of the block must reach it (no thread may have returned).
    pub fn bar_sync(&mut self) {
        self.ins(format_args!("bar.sync 0"));
    }

    /// `ret`
    pub fn ret(&mut self) {
        self.ins(format_args!("ret"));
    }

    /// `@p ret` (or `@!p` when `when` is false).
    pub fn ret_if(&mut self, p: Pred, when: bool) {
        self.ins_if(Some((p, when)), format_args!("ret"));
    }

    /// The `.entry` text.
    pub fn to_ptx(&self) -> String {
        let mut s = String::new();
        let _ = write!(s, ".visible .entry {}(", self.name);
        for (i, p) in self.params.iter().enumerate() {
            let sep = if i + 1 < self.params.len() { "," } else { "" };
            let _ = write!(s, "\n\t.param .{} {}{sep}", p.ty.name(), self.param_sym(i));
        }
        if self.params.is_empty() {
            s.push_str(")\n{\n");
        } else {
            s.push_str("\n)\n{\n");
        }
        for (ty, prefix, n) in [
            ("pred", "%p", self.n_pred),
            ("b16", "%rs", self.n_h16),
            ("b32", "%r", self.n_r32),
            ("b64", "%rd", self.n_r64),
            ("f32", "%f", self.n_f32),
        ] {
            if n > 0 {
                let _ = writeln!(s, "\t.reg .{ty} {prefix}<{n}>;");
            }
        }
        for (name, words, align) in &self.shared {
            let _ = writeln!(s, "\t.shared .align {align} .b32 {name}[{words}];");
        }
        if !self.body.is_empty() {
            s.push('\n');
        }
        s.push_str(&self.body);
        s.push_str("}\n");
        s
    }
}

fn mem_operand(addr: R64, off: u32) -> String {
    if off == 0 {
        format!("[{addr}]")
    } else {
        format!("[{addr}+{off}]")
    }
}

fn reg_list(regs: &[R32]) -> String {
    if regs.len() == 1 {
        regs[0].to_string()
    } else {
        let inner: Vec<String> = regs.iter().map(|r| r.to_string()).collect();
        format!("{{{}}}", inner.join(", "))
    }
}

/// A PTX module: a header for one [`Target`] and a list of kernels.
#[derive(Debug)]
pub struct Module {
    target: Target,
    kernels: Vec<Kernel>,
}

impl Module {
    /// An empty module for `target`.
    pub fn new(target: Target) -> Module {
        Module { target, kernels: Vec::new() }
    }

    /// Add a kernel.
    pub fn push(&mut self, kernel: Kernel) {
        assert!(self.kernels.iter().all(|k| k.name != kernel.name), "duplicate kernel {}", kernel.name);
        self.kernels.push(kernel);
    }

    /// The kernels, in the order they were added.
    pub fn kernels(&self) -> &[Kernel] {
        &self.kernels
    }

    /// The module's target.
    pub fn target(&self) -> Target {
        self.target
    }

    /// The module as PTX text.
    pub fn to_ptx(&self) -> String {
        let mut s = String::new();
        s.push_str("//\n// Generated by kvpool's kernels_build. Do not edit: regenerate with\n");
        s.push_str("// `cargo run -p kernels_build --bin gen-kernels`.\n//\n\n");
        let _ = writeln!(s, ".version {}", self.target.ptx_version());
        let _ = writeln!(s, ".target {}", self.target.sm());
        s.push_str(".address_size 64\n");
        for k in &self.kernels {
            s.push('\n');
            s.push_str(&k.to_ptx());
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registers_are_declared_from_use() {
        let mut k = Kernel::new("t");
        let p = k.param_u64("out");
        let a = k.ld_param_u64(p);
        let t = k.special(Special::TidX);
        let off = k.mul_wide_u32(t, 4u32);
        let at = k.add_u64(a, off);
        k.st_global_u32(at, 0, t, None);
        k.ret();
        let text = k.to_ptx();
        assert!(text.contains(".reg .b32 %r<1>;"), "{text}");
        assert!(text.contains(".reg .b64 %rd<3>;"), "{text}");
        assert!(!text.contains(".reg .pred"), "{text}");
        assert!(text.contains("ld.param.u64 %rd0, [t_param_out];"), "{text}");
        assert!(text.contains("mul.wide.u32 %rd1, %r0, 4;"), "{text}");
        assert!(text.contains("st.global.u32 [%rd2], %r0;"), "{text}");
    }

    #[test]
    fn vector_memory_operands() {
        let mut k = Kernel::new("v");
        let p = k.param_u64("x");
        let a = k.ld_param_u64(p);
        let r = k.ld_global(Width::B16, a, 16, true, None);
        let g = k.pred();
        k.st_global(Width::B16, a, 0, &r, Some((g, false)));
        let b = k.ld_global(Width::B1, a, 0, false, None);
        k.st_global(Width::B2, a, 2, &b, None);
        let text = k.to_ptx();
        assert!(text.contains("ld.global.nc.v4.u32 {%r0, %r1, %r2, %r3}, [%rd0+16];"), "{text}");
        assert!(text.contains("@!%p0 st.global.v4.u32 [%rd0], {%r0, %r1, %r2, %r3};"), "{text}");
        assert!(text.contains("ld.global.u8 %r4, [%rd0];"), "{text}");
        assert!(text.contains("st.global.u16 [%rd0+2], %r4;"), "{text}");
    }

    #[test]
    fn wide_loads_use_the_b64_class() {
        let mut k = Kernel::new("w");
        let p = k.param_u64("table");
        let a = k.ld_param_u64(p);
        let d = k.ld_global_u64(a, 8, true);
        let e = k.ld_global_u64(d, 0, false);
        k.st_global_u32(e, 0, 1u32, None);
        let text = k.to_ptx();
        assert!(text.contains("ld.global.nc.u64 %rd1, [%rd0+8];"), "{text}");
        assert!(text.contains("ld.global.u64 %rd2, [%rd1];"), "{text}");
        assert!(text.contains(".reg .b64 %rd<3>;"), "{text}");
    }

    #[test]
    fn labels_are_kernel_scoped() {
        let mut k = Kernel::new("loop");
        let l = k.label();
        k.place(l);
        let p = k.pred();
        k.bra_if(p, true, l);
        k.bra(l);
        let text = k.to_ptx();
        assert!(text.contains("$L__loop_0:\n"));
        assert!(text.contains("@%p0 bra $L__loop_0;"));
        assert!(text.contains("bra.uni $L__loop_0;"));
    }

    #[test]
    fn module_header_matches_target() {
        for t in Target::ALL {
            let mut m = Module::new(t);
            m.push(Kernel::new("empty"));
            let text = m.to_ptx();
            assert!(text.contains(&format!(".version {}\n.target {}\n.address_size 64\n", t.ptx_version(), t.sm())));
            assert!(text.contains(".visible .entry empty()\n{\n}\n"), "{text}");
        }
    }

    #[test]
    fn float_immediates_are_exact_hex() {
        let mut k = Kernel::new("f");
        let x = k.f32();
        k.mul_rn_f32_imm(x, 512.0);
        assert!(k.to_ptx().contains("mul.rn.f32 %f1, %f0, 0f44000000;"));
    }

    #[test]
    #[should_panic(expected = "duplicate parameter")]
    fn duplicate_params_are_refused() {
        let mut k = Kernel::new("d");
        k.param_u32("n");
        k.param_u64("n");
    }
}
