#!/bin/sh
# memlayout's best planned mode against the fastest other mode (eager, torch.compile, OpenVINO,
# ONNX Runtime), inference, fp32 and bf16, one process, interleaved rounds; then the bars.
OMP_WAIT_POLICY=PASSIVE memlayout bench torchvision:resnet50 torchvision:mobilenet_v2 \
    torchvision:efficientnet_b0 torchvision:convnext_tiny \
    --modes nchw,nhwc,compile,planned+compile,openvino,onnxruntime --dtype fp32,bf16 \
    --task infer --threads 2 --rounds 9 --out benchmarks/results/peer-bar
python benchmarks/bars.py benchmarks/results/peer-bar/results.json
