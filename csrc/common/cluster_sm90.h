// Thread-block clusters on sm_90 (PTX ISA 8.1): the cluster barrier, a partner CTA's shared-memory
// addresses (DSMEM), asynchronous stores into them that complete on the partner's mbarrier, and arrivals
// on a partner's mbarrier. Every address here is a 32-bit shared-window address (smem_addr / mapa).
#pragma once
#include <cstdint>

namespace msa::sm90 {

// Every thread of every CTA of the cluster: the writes before it are visible to the reads after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// The address of the same shared-memory location in CTA `rank` of the cluster.
__device__ __forceinline__ uint32_t cluster_map(uint32_t local_addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(local_addr), "r"(rank));
  return r;
}

// 16 bytes into a partner CTA's shared memory; completes 16 bytes of transactions on the partner's
// mbarrier `remote_bar` (both addresses from cluster_map).
__device__ __forceinline__ void st_async_v4(uint32_t remote_addr, float4 v, uint32_t remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n"
               ::"r"(remote_addr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(remote_bar) : "memory");
}

// One arrival on a partner CTA's mbarrier (address from cluster_map), relaxed: no memory ordering (a
// .release arrival compiles to MEMBAR.ALL.GPU, which waits for this thread's reds in flight). For
// "buffer read" signals whose reads were consumed (their values used) before the arrival.
__device__ __forceinline__ void mbar_arrive_remote(uint32_t remote_bar) {
  asm volatile("mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote_bar) : "memory");
}

// mbar_wait for a barrier that other CTAs of the cluster arrive on: acquire at cluster scope.
__device__ __forceinline__ void mbar_wait_cluster(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}

}  // namespace msa::sm90
