//! The serving core, which knows no model family: the paged KV pool, the
//! radix prefix cache, the scheduler, session scripts and the single-request
//! driver, and the disaggregated deployment (`disagg`: a prefill and a
//! decode scheduler joined by a K/V link). It sees a model only through
//! [`crate::model::ModelFamily`] and stores whatever
//! [`crate::model::KvLayout`] the family declares.

pub mod disagg;
pub mod generate;
pub mod pool;
pub mod radix;
pub mod scheduler;
pub mod session;
