//! CUDA graphs: a step's launches captured once ([`Gpu::begin_capture`],
//! [`Gpu::end_capture`]) and replayed as one ([`Graph::launch`]). A replay
//! runs the same kernels on the same addresses, so it gives the same bits.

use cudarc::driver::sys;

use super::{drv, Gpu, GpuError};

/// A captured sequence of launches on the [`Gpu`]'s stream, replayed as one
/// (CUDA graph): the same kernels, arguments and addresses as when captured.
pub struct Graph(pub(crate) cudarc::driver::CudaGraph);

// SAFETY: CUDA graph objects may be used from any thread as long as no two
// threads use one at the same time; `Graph` is `Send` but not `Sync`, so
// shared use needs a lock (the engine keeps its graphs behind a `Mutex`).
unsafe impl Send for Graph {}

impl Graph {
    /// Replays the launches (asynchronously, on the stream).
    pub fn launch(&self) -> Result<(), GpuError> {
        self.0.launch().map_err(drv)
    }
}

impl Gpu {
    /// Starts capturing the stream's launches into a [`Graph`].
    pub fn begin_capture(&self) -> Result<(), GpuError> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(drv)
    }

    /// Ends a capture; `None` when nothing was captured.
    pub fn end_capture(&self) -> Result<Option<Graph>, GpuError> {
        let g = self
            .stream
            .end_capture(
                sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            )
            .map_err(drv)?;
        Ok(g.map(Graph))
    }
}
