#!/bin/sh
# memlayout's best planned mode against the peer runtimes (OpenVINO, ONNX Runtime), inference,
# fp32 and bf16, one process, interleaved rounds; then the bars read from the results.
OMP_WAIT_POLICY=PASSIVE memlayout bench torchvision:resnet50 torchvision:mobilenet_v2 \
    --modes nchw,nhwc,compile,planned+compile,openvino,onnxruntime --dtype fp32,bf16 \
    --task infer --threads 2 --rounds 9 --out docs/bench/peer-bar
python docs/bench/bars.py docs/bench/peer-bar/results.json
# efficientnet_b0 and convnext_tiny, the same settings
OMP_WAIT_POLICY=PASSIVE memlayout bench torchvision:efficientnet_b0 torchvision:convnext_tiny \
    --modes nchw,nhwc,compile,planned+compile,openvino,onnxruntime --dtype fp32,bf16 \
    --task infer --threads 2 --rounds 9 --out docs/bench/peer-bar/more
python docs/bench/bars.py docs/bench/peer-bar/more/results.json
