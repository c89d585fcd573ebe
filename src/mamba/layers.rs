//! [`HybridLayerMap`]: which model layers are full attention (KV buffers) and which are
//! Mamba (state slots) — SGLang's `HybridLinearKVPool` id mapping and `mamba_map`.

use core::fmt;

use crate::error::ConfigError;

/// What a layer is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// Full attention: paged KV.
    FullAttention,
    /// Mamba / linear attention: a state slot per request.
    Mamba,
}

/// A layer id was asked for as the wrong kind. Names the valid ids.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LayerError {
    /// The layer id asked for.
    pub layer: u32,
    /// The kind it was asked as.
    pub wanted: LayerKind,
    /// What it is (`None`: not a layer of the model).
    pub actual: Option<LayerKind>,
    /// The layer ids of the wanted kind, ascending.
    pub valid: Vec<u32>,
}

impl fmt::Display for LayerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let wanted = match self.wanted {
            LayerKind::FullAttention => "full attention",
            LayerKind::Mamba => "Mamba",
        };
        match self.actual {
            Some(LayerKind::FullAttention) => write!(f, "layer {} is a full attention layer", self.layer)?,
            Some(LayerKind::Mamba) => write!(f, "layer {} is a Mamba layer", self.layer)?,
            None => write!(f, "layer {} is not a layer of this model", self.layer)?,
        }
        write!(f, ", not {wanted}; {wanted} layers are {:?}", self.valid)
    }
}

impl std::error::Error for LayerError {}

/// The layers of a hybrid model: `full_attention_layer_ids[i]` is KV buffer `i`,
/// `mamba_layer_ids[j]` is Mamba state layer `j`. Lookups are one array load.
///
/// # Examples
///
/// ```
/// use kvpool::mamba::{HybridLayerMap, LayerKind};
///
/// // 8 layers, every fourth is full attention (Qwen3-Next's pattern).
/// let map = HybridLayerMap::new(8, &[3, 7], &[0, 1, 2, 4, 5, 6])?;
/// assert_eq!(map.kv_index(7)?, 1);
/// assert_eq!(map.mamba_index(4)?, 3);
/// let err = map.kv_index(2).unwrap_err();
/// assert_eq!(err.valid, [3, 7]);
/// assert_eq!(err.actual, Some(LayerKind::Mamba));
/// assert_eq!(err.to_string(), "layer 2 is a Mamba layer, not full attention; full attention layers are [3, 7]");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HybridLayerMap {
    /// Per layer id: `ATTN | kv index`, `MAMBA | state index`, or `NONE`.
    table: Box<[u32]>,
    full_attention: Box<[u32]>,
    mamba: Box<[u32]>,
}

const NONE: u32 = u32::MAX;
const MAMBA: u32 = 1 << 31;

impl HybridLayerMap {
    /// A model of `num_layers` layers. Ids may be listed in any order; each list's
    /// order gives the dense indices. Layers in neither list are neither.
    ///
    /// # Errors
    ///
    /// [`ConfigError::TooLarge`] for an id `>= num_layers` (its `size` field) or an id
    /// listed twice (in one list or both).
    pub fn new(
        num_layers: u32,
        full_attention_layer_ids: &[u32],
        mamba_layer_ids: &[u32],
    ) -> Result<Self, ConfigError> {
        if num_layers >= MAMBA {
            return Err(ConfigError::TooLarge { size: num_layers as u64, page_size: 1 });
        }
        let mut table = vec![NONE; num_layers as usize].into_boxed_slice();
        let lists = [(full_attention_layer_ids, 0), (mamba_layer_ids, MAMBA)];
        for (ids, tag) in lists {
            for (i, &id) in ids.iter().enumerate() {
                match table.get_mut(id as usize) {
                    Some(e) if *e == NONE => *e = tag | i as u32,
                    _ => return Err(ConfigError::TooLarge { size: id as u64, page_size: 1 }),
                }
            }
        }
        let sorted = |ids: &[u32]| {
            let mut v = ids.to_vec();
            v.sort_unstable();
            v.into_boxed_slice()
        };
        Ok(HybridLayerMap { table, full_attention: sorted(full_attention_layer_ids), mamba: sorted(mamba_layer_ids) })
    }

    /// Number of layers of the model.
    pub fn num_layers(&self) -> usize {
        self.table.len()
    }

    /// The full attention layer ids, ascending.
    pub fn full_attention_layers(&self) -> &[u32] {
        &self.full_attention
    }

    /// The Mamba layer ids, ascending.
    pub fn mamba_layers(&self) -> &[u32] {
        &self.mamba
    }

    /// What layer `layer` is (`None` if neither or out of range).
    pub fn kind(&self, layer: u32) -> Option<LayerKind> {
        match *self.table.get(layer as usize)? {
            NONE => None,
            e if e & MAMBA != 0 => Some(LayerKind::Mamba),
            _ => Some(LayerKind::FullAttention),
        }
    }

    /// The KV buffer index of full attention layer `layer` (SGLang's
    /// `_transfer_full_attention_id`).
    ///
    /// # Errors
    ///
    /// [`LayerError`] naming the full attention layer ids, for any other layer.
    pub fn kv_index(&self, layer: u32) -> Result<usize, LayerError> {
        match self.table.get(layer as usize) {
            Some(&e) if e != NONE && e & MAMBA == 0 => Ok(e as usize),
            _ => Err(self.error(layer, LayerKind::FullAttention)),
        }
    }

    /// The state layer index of Mamba layer `layer` (SGLang's `mamba_map`).
    ///
    /// # Errors
    ///
    /// [`LayerError`] naming the Mamba layer ids, for any other layer.
    pub fn mamba_index(&self, layer: u32) -> Result<usize, LayerError> {
        match self.table.get(layer as usize) {
            Some(&e) if e != NONE && e & MAMBA != 0 => Ok((e & !MAMBA) as usize),
            _ => Err(self.error(layer, LayerKind::Mamba)),
        }
    }

    #[cold]
    fn error(&self, layer: u32, wanted: LayerKind) -> LayerError {
        let valid = match wanted {
            LayerKind::FullAttention => self.full_attention.to_vec(),
            LayerKind::Mamba => self.mamba.to_vec(),
        };
        LayerError { layer, wanted, actual: self.kind(layer), valid }
    }
}
