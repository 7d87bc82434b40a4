// tc_probe's kernel: one warp per m16n8k16 instruction, operands as
// tensor_core::probe::Tile lays them out (A 16x16 row-major, B 8 columns of
// 16, C and D 16x8 row-major), fragments placed as PTX's ISA gives for
// mma.m16n8k16 .bf16 .row.col (group g = lane / 4, thread t = lane % 4; the
// lower k of each pair in the register's low half).
extern "C" __global__ void tc_probe_bf16(const unsigned short* A, const unsigned short* B,
                                         const float* C, float* D, int tiles) {
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= tiles) return;
    const unsigned short* a = A + (size_t)warp * 256;
    const unsigned short* b = B + (size_t)warp * 128;
    const float* c = C + (size_t)warp * 128;
    float* d = D + (size_t)warp * 128;
    int g = lane >> 2, t = lane & 3;
#define PAIR(p, i) ((unsigned)(p)[i] | ((unsigned)(p)[(i) + 1] << 16))
    unsigned a0 = PAIR(a, g * 16 + t * 2), a1 = PAIR(a, (g + 8) * 16 + t * 2);
    unsigned a2 = PAIR(a, g * 16 + t * 2 + 8), a3 = PAIR(a, (g + 8) * 16 + t * 2 + 8);
    unsigned b0 = PAIR(b, g * 16 + t * 2), b1 = PAIR(b, g * 16 + t * 2 + 8);
#undef PAIR
    float c0 = c[g * 8 + t * 2], c1 = c[g * 8 + t * 2 + 1];
    float c2 = c[(g + 8) * 8 + t * 2], c3 = c[(g + 8) * 8 + t * 2 + 1];
    float d0, d1, d2, d3;
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d0), "=f"(d1), "=f"(d2), "=f"(d3)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1),
          "f"(c0), "f"(c1), "f"(c2), "f"(c3));
    d[g * 8 + t * 2] = d0;
    d[g * 8 + t * 2 + 1] = d1;
    d[(g + 8) * 8 + t * 2] = d2;
    d[(g + 8) * 8 + t * 2 + 1] = d3;
}
