#!/bin/bash
# usage: [ISA=native] ab.sh SETS LO HI config...   (F fresh, G fresh + learnt gate, L fresh + learnt gate and policy,
#   P fresh with the draft copy that carries lookup_prior.json; default ISA: the AVX2 cap)
source /tmp/heterospec-ci-venv/bin/activate; export PYTHONPATH=/work/main
[ "${ISA:-cap}" = cap ] && export MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
SETS=$1; LO=$2; HI=$3; shift 3
src=/tmp/s77/gate/learnt; i=0
for c in "$@"; do
  i=$((i+1)); d=/tmp/s77/gate/cache_$i; rm -rf $d; cp -a /tmp/s76/fresh $d
  case $c in G) cp $src/*.lookup.json $d/costs/;; L) cp $src/*.online-* $d/costs/;; esac
  DR=/tmp/s77/draft-base; [ $c = P ] && DR=/tmp/s77/draft-prior
  r=$(DRAFT=$DR HETEROSPEC_CACHE=$d python run1.py $SETS $LO $HI 2>err_$i.log | tail -1)
  echo "$r" > ${ISA:-cap}_run_${i}_$c.json
  echo "$i $c $(echo $r | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["ratio"],3))')" | tee -a ab.log
done
