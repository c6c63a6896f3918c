"""One readable run() per job kind (grpo, tracin, joint, sft) and the parts they are built from (setup,
rollouts, update, evaluation, skeleton). They import the engines, the model room, rewards, algos and
`service.core`; they report through the Reporter seam (worker/reporting.py), never to the store."""
