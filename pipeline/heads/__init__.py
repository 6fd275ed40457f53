"""Feature heads: drafters that read the target's own hidden states.

    medusa.py   Medusa heads (Cai et al. 2024): K residual heads on the target's last hidden state, head i
                predicting the token i+1 places past the next one, all in one pass; Medusa's checkpoint layout
    eagle3.py   an EAGLE-3 head (Li et al. 2025): the target's low, middle and high hidden states fused (fc),
                one decoder layer over [embed(token); feature], a frequency-ranked draft vocabulary (d2t);
                autoregressive over its own features after the first token; vLLM/SGLang's checkpoint layout
    drafter.py  `HeadDrafter`: either head behind the `Drafter` interface, fed with the features of the
                accepted tokens that the target's verify pass returns

The target computes the features in its own passes (`LlamaCausalLM.forward_features`); the engine keeps, per
request, those of the committed positions the head has not read yet.
"""
