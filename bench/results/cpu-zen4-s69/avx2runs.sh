set -x
cd /work/main
export MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
R=bench/results/cpu-zen4-s69
rm -f ~/.cache/heterospec/costs/*.online-*
heterospec bench --methods autoregressive eagle3 heterospec --sets mtbench humaneval gsm alpaca cnndm --n 4 --max-new-tokens 128 --draft-dtype float32 --out $R/f32-avx2cap
rm -f ~/.cache/heterospec/costs/*.online-*
heterospec batch-sweep --batch-sizes 1 2 4 8 16 --prompts-per-size 32 --max-new-tokens 96 --methods autoregressive heterospec --repeats 2 --draft-dtype float32 --out $R/sweep-f32-avx2cap
echo done
