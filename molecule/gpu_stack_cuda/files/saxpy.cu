// A kernel and its launch, compiled by the verify for Hopper (sm_90). The node has no GPU, so the
// program stops at its first runtime call with the runtime's own error name: that it got that far
// shows the loader found libcudart (without it the program would not start at all).
#include <cstdio>
#include <cuda_runtime.h>

__global__ void saxpy(int n, float a, const float *x, float *y) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}

int main() {
  std::printf("built for CUDA runtime %d\n", CUDART_VERSION);
  int devices = 0;
  cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess) {
    std::printf("no device: %s\n", cudaGetErrorName(err));
    return 2;
  }
  const int n = 1 << 20;
  float *x, *y;
  cudaMallocManaged(&x, n * sizeof(float));
  cudaMallocManaged(&y, n * sizeof(float));
  for (int i = 0; i < n; i++) { x[i] = 1.0f; y[i] = 2.0f; }
  saxpy<<<(n + 255) / 256, 256>>>(n, 2.0f, x, y);
  cudaDeviceSynchronize();
  std::printf("y[0] = %.1f on %d device(s)\n", y[0], devices);
  cudaFree(x);
  cudaFree(y);
  return 0;
}
