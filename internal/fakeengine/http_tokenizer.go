package fakeengine

import (
	"unicode"
	"unicode/utf8"

	"github.com/cespare/xxhash/v2"
)

// The fake engine's toy vocabulary. Ids below FirstWordToken are special tokens
// that no text ever tokenizes to; every word or punctuation mark maps to an id in
// [FirstWordToken, VocabSize). The same functions back the HTTP server and the
// exported helpers, so tests can compute the ids the server will use.
const (
	// TokenBOS starts every chat template and, with add_special_tokens, every
	// completions prompt.
	TokenBOS uint32 = 1
	// TokenEndOfTurn closes each chat message.
	TokenEndOfTurn uint32 = 2
	// TokenSystem, TokenUser, TokenAssistant and TokenTool open a message of
	// that role ("developer" uses TokenSystem). TokenAssistant also ends the
	// template as the generation prompt.
	TokenSystem    uint32 = 3
	TokenUser      uint32 = 4
	TokenAssistant uint32 = 5
	TokenTool      uint32 = 6
	// TokenOtherRole opens a message of any other role; the role name's own
	// tokens follow it.
	TokenOtherRole uint32 = 7
	// FirstWordToken is the smallest id a word or punctuation mark can get.
	FirstWordToken uint32 = 1000
	// VocabSize bounds every id: token-id prompts with an id >= VocabSize are
	// rejected with 400, as vLLM rejects out-of-vocabulary ids.
	VocabSize uint32 = 32000
)

var specialStrings = map[uint32]string{
	TokenBOS:       "<s>",
	TokenEndOfTurn: "<|end|>",
	TokenSystem:    "<|system|>",
	TokenUser:      "<|user|>",
	TokenAssistant: "<|assistant|>",
	TokenTool:      "<|tool|>",
	TokenOtherRole: "<|role|>",
}

// Message is one chat message as the template sees it: a role and its text
// (the text parts of an OpenAI content array, joined by one space).
type Message struct {
	Role    string
	Content string
}

// TemplateOptions are the chat template flags of vLLM's chat endpoints. The zero
// value is vLLM's default for a chat request: generation prompt on, the final
// message closed, no extra special tokens.
type TemplateOptions struct {
	// NoGenerationPrompt leaves out the trailing TokenAssistant
	// (add_generation_prompt=false).
	NoGenerationPrompt bool
	// ContinueFinalMessage leaves the last message open (no TokenEndOfTurn) and
	// adds no generation prompt (continue_final_message=true).
	ContinueFinalMessage bool
	// AddSpecialTokens puts the tokenizer's own BOS in front of the template's,
	// which is what vLLM does with add_special_tokens=true on a chat request (a
	// double BOS).
	AddSpecialTokens bool
}

// Tokenize splits text into tokens: a run of letters and digits is one token, any
// other character that is not white space is a token of its own, and white space
// only separates. Each token's id is a hash of its text in [FirstWordToken,
// VocabSize). No special token is added. It is a pure function.
func Tokenize(text string) []uint32 {
	return appendTokens(nil, nil, text)
}

// CompletionTokens returns the ids the server uses for a /v1/completions string
// prompt with vLLM's default add_special_tokens=true: TokenBOS, then
// Tokenize(prompt).
func CompletionTokens(prompt string) []uint32 {
	return appendTokens([]uint32{TokenBOS}, nil, prompt)
}

// ApplyChatTemplate returns the ids the server uses for a chat request with the
// default flags: TokenBOS, then for each message its role token, its content's
// tokens and TokenEndOfTurn, then TokenAssistant. Identical leading messages
// therefore give identical leading ids. It is a pure function.
func ApplyChatTemplate(messages []Message) []uint32 {
	return ApplyChatTemplateWith(messages, TemplateOptions{})
}

// ApplyChatTemplateWith is ApplyChatTemplate with explicit flags (see
// TemplateOptions).
func ApplyChatTemplateWith(messages []Message, o TemplateOptions) []uint32 {
	return renderChat(nil, messages, o)
}

// renderChat returns the template's ids and, when strs is not nil, appends their
// strings to *strs.
func renderChat(strs *[]string, messages []Message, o TemplateOptions) []uint32 {
	var out []uint32
	if o.AddSpecialTokens {
		out = appendSpecial(out, strs, TokenBOS)
	}
	out = appendSpecial(out, strs, TokenBOS)
	for i, m := range messages {
		switch m.Role {
		case "system", "developer":
			out = appendSpecial(out, strs, TokenSystem)
		case "user":
			out = appendSpecial(out, strs, TokenUser)
		case "assistant":
			out = appendSpecial(out, strs, TokenAssistant)
		case "tool":
			out = appendSpecial(out, strs, TokenTool)
		default:
			out = appendSpecial(out, strs, TokenOtherRole)
			out = appendTokens(out, strs, m.Role)
		}
		out = appendTokens(out, strs, m.Content)
		if !(o.ContinueFinalMessage && i == len(messages)-1) {
			out = appendSpecial(out, strs, TokenEndOfTurn)
		}
	}
	if !o.NoGenerationPrompt && !o.ContinueFinalMessage {
		out = appendSpecial(out, strs, TokenAssistant)
	}
	return out
}

// renderPrompt returns the ids of a completions string prompt.
func renderPrompt(strs *[]string, prompt string, addSpecial bool) []uint32 {
	var out []uint32
	if addSpecial {
		out = appendSpecial(out, strs, TokenBOS)
	}
	return appendTokens(out, strs, prompt)
}

func appendSpecial(dst []uint32, strs *[]string, id uint32) []uint32 {
	if strs != nil {
		*strs = append(*strs, specialStrings[id])
	}
	return append(dst, id)
}

// appendTokens appends the ids of text's tokens to dst and, when strs is not nil,
// the tokens' text to *strs.
func appendTokens(dst []uint32, strs *[]string, text string) []uint32 {
	word := -1 // start of the current letter/digit run, -1 when none
	emit := func(s string) {
		dst = append(dst, wordID(s))
		if strs != nil {
			*strs = append(*strs, s)
		}
	}
	for i := 0; i < len(text); {
		r, size := utf8.DecodeRuneInString(text[i:])
		switch {
		case unicode.IsLetter(r) || unicode.IsDigit(r):
			if word < 0 {
				word = i
			}
		default:
			if word >= 0 {
				emit(text[word:i])
				word = -1
			}
			if !unicode.IsSpace(r) {
				emit(text[i : i+size])
			}
		}
		i += size
	}
	if word >= 0 {
		emit(text[word:])
	}
	return dst
}

// wordID maps a token's text into [FirstWordToken, VocabSize).
func wordID(s string) uint32 {
	return FirstWordToken + uint32(xxhash.Sum64String(s)%uint64(VocabSize-FirstWordToken))
}

// outputWords is the dummy text generated for completions, one token per word.
var outputWords = [...]string{"lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit"}

// outputPiece returns generated token i's text: its word, with a leading space
// except for the first one, so that the pieces concatenate to the whole text.
func outputPiece(i int) string {
	w := outputWords[i%len(outputWords)]
	if i == 0 {
		return w
	}
	return " " + w
}
